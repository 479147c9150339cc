//! Hopper's warpgroup products ([`wgmma`](crate::kernel::tile::wgmma)), the forward and the
//! backward on them ([`warpgroup`](crate::kernel::forward::warpgroup),
//! [`warpgroup`](crate::kernel::backward::warpgroup)) on the GPU, against f64 references: each
//! product on its own, one query block's attention on them, and the forward's and backward's
//! launches on ragged shapes. They skip without an SM90 device.

use cubecl::prelude::*;

use super::{Case, Inputs, Rng, assert_close};
use crate::kernel::ScoreParams;
use crate::kernel::config::{Switch, WarpgroupConfig};
use crate::kernel::device::DeviceCaps;
use crate::kernel::forward::warpgroup::launch_cubes;
use crate::kernel::grid::batch_inner;
use crate::kernel::pack::pack_mask;
use crate::kernel::tensors::{BF16, F32, KernelTensor, ScoreInputs, output};
use crate::kernel::tile::wgmma::{
    descriptor, descriptor_across_rows, fragment_position, position, product, product_across_rows,
    product_pv, swizzled, wait_products,
};
use crate::kernel::{backward, forward};
use crate::{CausalAlignment, FlashAttentionOptions};

/// The 32 f32 accumulators one unit of a warpgroup holds of a 64 × 64 tile.
type Accumulators = Vector<f32, Const<32>>;
/// Registers of A a unit holds for [`product_pv`] over 64 keys: four 32-bit registers (two
/// 16-bit values each) per k-step of 16, four k-steps.
type Fragment = Vector<u32, Const<16>>;
/// A 64 × 64 tile of 16-bit values, one panel.
const PANEL_BYTES: u64 = 64 * 128;

/// One warpgroup: A and B (64 × 64, rows of the reduced dim) staged swizzled, their product
/// by four k-steps, both operands read K-major ([`product`]: `A · Bᵀ`) or, `across_rows`,
/// across their rows ([`product_across_rows`]: `Aᵀ · B`), the accumulators written out by
/// [`position`].
#[cube(launch_unchecked)]
fn product_probe<E: Float>(
    a: &Tensor<E>,
    b: &Tensor<E>,
    out: &mut Tensor<f32>,
    #[comptime] across_rows: bool,
    #[define(E)] _dtype: ElemType,
) {
    let mut a_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    let mut b_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    #[unroll]
    for i in 0..32usize {
        let at = UNIT_POS as usize * 32 + i;
        let (row, col) = (at / 64, at % 64);
        a_tile[swizzled(row, col)] = a[at];
        b_tile[swizzled(row, col)] = b[at];
    }
    // The products read shared memory through the async proxy.
    sync_async_proxy_shared();
    sync_cube();
    let d = if comptime!(across_rows) {
        let a = descriptor_across_rows::<E>(&a_tile, PANEL_BYTES);
        let b = descriptor_across_rows::<E>(&b_tile, PANEL_BYTES);
        product_across_rows::<Const<32>>(a, b, 64usize, 64usize, true)
    } else {
        let (a, b) = (descriptor::<E>(&a_tile), descriptor::<E>(&b_tile));
        product::<Const<32>>(a, b, 64usize, 64usize, 64usize, true)
    };
    wait_products();
    #[unroll]
    for nth in 0..32usize {
        let (row, col) = position(UNIT_POS as usize, nth);
        out[row * 64 + col] = d.extract(nth);
    }
}

/// One warpgroup: `O + P · V` with O and P (64 × 64) from global memory into the
/// accumulators and the fragment, V (64 keys × 64 values) staged swizzled.
#[cube(launch_unchecked)]
fn product_pv_probe<E: Float>(
    o: &Tensor<f32>,
    p: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<f32>,
    #[define(E)] _dtype: ElemType,
) {
    let mut v_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    #[unroll]
    for i in 0..32usize {
        let at = UNIT_POS as usize * 32 + i;
        v_tile[swizzled(at / 64, at % 64)] = v[at];
    }
    let mut acc = Accumulators::empty();
    #[unroll]
    for nth in 0..32usize {
        let (row, col) = position(UNIT_POS as usize, nth);
        acc.insert(nth, o[row * 64 + col]);
    }
    let mut fragment = Fragment::empty();
    #[unroll]
    for nth in 0..16usize {
        let (row, col) = fragment_position(UNIT_POS as usize, nth);
        let mut pair = Vector::<E, Const<2>>::empty();
        pair.insert(0usize, p[row * 64 + col]);
        pair.insert(1usize, p[row * 64 + col + 1]);
        fragment.insert(nth, u32::reinterpret(pair));
    }
    sync_async_proxy_shared();
    sync_cube();
    let v = descriptor_across_rows::<E>(&v_tile, PANEL_BYTES);
    let d = product_pv::<Const<32>, Const<16>>(acc, fragment, v, 64usize, 64usize, true);
    wait_products();
    #[unroll]
    for nth in 0..32usize {
        let (row, col) = position(UNIT_POS as usize, nth);
        out[row * 64 + col] = d.extract(nth);
    }
}

/// One query block's attention over `k.shape(0) / 64` key blocks with the two products:
/// `S = Q · Kᵀ`, the online softmax on its accumulators (each row's four lanes combined by
/// shuffles), `P` packed from them into the registers of `O + P · V`. Head dim 64, scale
/// 1/8, every key seen; blocks staged by the units, one at a time.
#[cube(launch_unchecked)]
fn attention_probe<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<f32>,
    #[define(E)] _dtype: ElemType,
) {
    let unit = UNIT_POS as usize;
    let mut q_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    let mut k_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    let mut v_tile = Shared::<[E]>::new_aligned_slice(64usize * 64, 1024usize);
    #[unroll]
    for i in 0..32usize {
        let at = unit * 32 + i;
        q_tile[swizzled(at / 64, at % 64)] = q[at];
    }
    let scale = 0.125f32;
    let mut o = Accumulators::new(0.0);
    // Each unit's two rows (`16 w + lane / 4` and 8 below): running max and its part of
    // the row sum.
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        // Below any score: the first block's rescale factor is exp(-huge) = 0.
        row_max[h] = -1.0e30f32;
        row_sum[h] = 0.0;
    }
    for block in 0..k.shape(0) / 64 {
        // Every unit waited for the last products: the tiles may be refilled.
        sync_cube();
        #[unroll]
        for i in 0..32usize {
            let at = unit * 32 + i;
            let from = (block * 64 + at / 64) * 64 + at % 64;
            k_tile[swizzled(at / 64, at % 64)] = k[from];
            v_tile[swizzled(at / 64, at % 64)] = v[from];
        }
        sync_async_proxy_shared();
        sync_cube();
        let (dq, dk) = (descriptor::<E>(&q_tile), descriptor::<E>(&k_tile));
        let s = product::<Const<32>>(dq, dk, 64usize, 64usize, 64usize, true);
        wait_products();
        let mut alpha = Array::<f32>::new(2usize);
        #[unroll]
        for h in 0..2usize {
            let mut m = row_max[h];
            #[unroll]
            for nth in 0..32usize {
                if comptime!((nth % 4) / 2 == h) {
                    m = max(m, s.extract(nth) * scale);
                }
            }
            m = max(m, plane_shuffle_xor(m, 1));
            m = max(m, plane_shuffle_xor(m, 2));
            alpha[h] = (row_max[h] - m).exp();
            row_max[h] = m;
            row_sum[h] *= alpha[h];
        }
        // Accumulators 2f and 2f + 1 are register f of P's fragment (same row, adjacent
        // columns; see `fragment_position`).
        let mut fragment = Fragment::empty();
        #[unroll]
        for f in 0..16usize {
            let h = comptime!(f % 2);
            let p0 = (s.extract(comptime!(2 * f)) * scale - row_max[h]).exp();
            let p1 = (s.extract(comptime!(2 * f + 1)) * scale - row_max[h]).exp();
            row_sum[h] += p0 + p1;
            let mut pair = Vector::<E, Const<2>>::empty();
            pair.insert(0usize, E::cast_from(p0));
            pair.insert(1usize, E::cast_from(p1));
            fragment.insert(f, u32::reinterpret(pair));
        }
        #[unroll]
        for nth in 0..32usize {
            let h = comptime!((nth % 4) / 2);
            o.insert(nth, o.extract(nth) * alpha[h]);
        }
        let dv = descriptor_across_rows::<E>(&v_tile, PANEL_BYTES);
        o = product_pv::<Const<32>, Const<16>>(o, fragment, dv, 64usize, 64usize, true);
        wait_products();
    }
    #[unroll]
    for h in 0..2usize {
        let part = row_sum[h];
        let pair = part + plane_shuffle_xor(part, 1);
        row_sum[h] = pair + plane_shuffle_xor(pair, 2);
    }
    #[unroll]
    for nth in 0..32usize {
        let (row, col) = position(unit, nth);
        out[row * 64 + col] = o.extract(nth) / row_sum[comptime!((nth % 4) / 2)];
    }
}

/// The first CUDA device with tensor maps (SM90 and newer), or `None` after a printed
/// reason; panics instead where `BURN_FLASH_REQUIRE_CUDA` is set.
fn hopper_or_skip(test: &str) -> Option<Client> {
    let client = cubecl::Device::enumerate_all()
        .into_iter()
        .find(|d| matches!(d, cubecl::Device::Cuda(_)))
        .map(|device| device.client());
    let reason = match &client {
        None => "no CUDA device",
        Some(client) if !DeviceCaps::of(client, BF16).tma => "a CUDA device before SM90",
        Some(_) => return client,
    };
    assert!(
        std::env::var_os("BURN_FLASH_REQUIRE_CUDA").is_none(),
        "{test}: BURN_FLASH_REQUIRE_CUDA is set: {reason}"
    );
    eprintln!("{test}: skipping: {reason}");
    None
}

fn bf16s(rng: &mut Rng) -> Vec<half::bf16> {
    rng.normals(64 * 64)
        .into_iter()
        .map(half::bf16::from_f32)
        .collect()
}

/// `got` (64 × 64, f32) against `base + Σ terms` in f64 at each `(i, j)`: f32 accumulation
/// of exact bf16 products is within 64 f32 roundings of the sum of the magnitudes; a wrong
/// row, column, swizzle or descriptor is off by O(1).
fn check_product(label: &str, got: &[f32], expected: impl Fn(usize, usize) -> (f64, Vec<f64>)) {
    let mut worst = 0f64;
    for (i, row) in got.chunks(64).enumerate() {
        for (j, &value) in row.iter().enumerate() {
            let (base, terms) = expected(i, j);
            let exact = base + terms.iter().sum::<f64>();
            let magnitude = base.abs() + terms.iter().map(|t| t.abs()).sum::<f64>();
            let bound = magnitude * 64.0 * f32::EPSILON as f64;
            let error = (value as f64 - exact).abs();
            assert!(
                error.is_finite() && error <= bound,
                "{label}: [{i}][{j}] = {value}, expected {exact} (bound {bound})"
            );
            worst = worst.max(error);
        }
    }
    eprintln!("{label}, 64x64x64 bf16: largest error {worst:.3e}");
}

/// [`product_probe`] on fresh bf16 inputs from `seed`: A, B and the f32 result, row-major.
fn run_product_probe(
    client: &Client,
    seed: u64,
    across_rows: bool,
) -> (Vec<half::bf16>, Vec<half::bf16>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let (a, b) = (bf16s(&mut rng), bf16s(&mut rng));
    let out = KernelTensor::from_f32(client, &[f32::NAN; 64 * 64], [64, 64]);
    let [a_dev, b_dev] = [&a, &b].map(|v| KernelTensor::from_values(client, v, [64, 64]));
    // SAFETY: one cube of 128 units, each reading its 32 of the 4096 inputs and writing its
    // 32 of the 4096 outputs.
    unsafe {
        product_probe::launch_unchecked(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(128),
            a_dev.into_tensor_arg(),
            b_dev.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            across_rows,
            BF16,
        );
    }
    (a, b, out.read::<f32>())
}

#[test]
fn warpgroup_product_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_product_matches_the_reference_cuda") else {
        return;
    };
    let (a, b, got) = run_product_probe(&client, 50, false);
    // A · Bᵀ: row i of A against row j of B.
    check_product("A B^T", &got, |i, j| {
        let terms = (0..64).map(|k| a[i * 64 + k].to_f64() * b[j * 64 + k].to_f64());
        (0.0, terms.collect())
    });
}

#[test]
fn warpgroup_product_across_rows_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_product_across_rows_matches_the_reference_cuda")
    else {
        return;
    };
    let (a, b, got) = run_product_probe(&client, 53, true);
    // Aᵀ · B: column i of A against column j of B, both stored as rows of the reduced dim.
    check_product("A^T B", &got, |i, j| {
        let terms = (0..64).map(|k| a[k * 64 + i].to_f64() * b[k * 64 + j].to_f64());
        (0.0, terms.collect())
    });
}

#[test]
fn warpgroup_product_pv_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_product_pv_matches_the_reference_cuda") else {
        return;
    };
    let mut rng = Rng::new(51);
    let o = rng.normals(64 * 64);
    let (p, v) = (bf16s(&mut rng), bf16s(&mut rng));
    let out = KernelTensor::from_f32(&client, &[f32::NAN; 64 * 64], [64, 64]);
    let o_dev = KernelTensor::from_f32(&client, &o, [64, 64]);
    let [p_dev, v_dev] = [&p, &v].map(|x| KernelTensor::from_values(&client, x, [64, 64]));
    // SAFETY: one cube of 128 units, each reading its 32 values of V, its accumulators and
    // its fragment, and writing its 32 outputs.
    unsafe {
        product_pv_probe::launch_unchecked(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(128),
            o_dev.into_tensor_arg(),
            p_dev.into_tensor_arg(),
            v_dev.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            BF16,
        );
    }
    // O + P · V: row i of P against column j of V.
    check_product("O + P V", &out.read::<f32>(), |i, j| {
        let terms = (0..64).map(|k| p[i * 64 + k].to_f64() * v[k * 64 + j].to_f64());
        (o[i * 64 + j] as f64, terms.collect())
    });
}

#[test]
fn warpgroup_attention_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_attention_matches_the_reference_cuda") else {
        return;
    };
    let mut rng = Rng::new(52);
    let keys = 256;
    let round = |values: Vec<f32>| -> Vec<half::bf16> {
        values.into_iter().map(half::bf16::from_f32).collect()
    };
    let q = bf16s(&mut rng);
    let (k, v) = (round(rng.normals(keys * 64)), round(rng.normals(keys * 64)));
    let out = KernelTensor::from_f32(&client, &[f32::NAN; 64 * 64], [64, 64]);
    let q_dev = KernelTensor::from_values(&client, &q, [64, 64]);
    let [k_dev, v_dev] = [&k, &v].map(|x| KernelTensor::from_values(&client, x, [keys, 64]));
    // SAFETY: one cube of 128 units, reading the 64 query rows and every key block, each
    // unit writing its 32 outputs.
    unsafe {
        attention_probe::launch_unchecked(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(128),
            q_dev.into_tensor_arg(),
            k_dev.into_tensor_arg(),
            v_dev.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            BF16,
        );
    }
    let got = out.read::<f32>();
    let (mut worst, mut largest) = (0f64, 0f64);
    for i in 0..64 {
        let scores: Vec<f64> = (0..keys)
            .map(|j| {
                (0..64)
                    .map(|c| q[i * 64 + c].to_f64() * k[j * 64 + c].to_f64())
                    .sum::<f64>()
                    / 8.0
            })
            .collect();
        let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
        let total: f64 = weights.iter().sum();
        for c in 0..64 {
            let exact = (0..keys)
                .map(|j| weights[j] * v[j * 64 + c].to_f64())
                .sum::<f64>()
                / total;
            let value = got[i * 64 + c] as f64;
            assert!(value.is_finite(), "O[{i}][{c}] = {value}");
            worst = worst.max((value - exact).abs());
            largest = largest.max(exact.abs());
        }
    }
    eprintln!(
        "warpgroup attention, 64 rows over {keys} keys: largest error {worst:.3e} (largest value {largest:.3})"
    );
    // P enters the second product in bf16 (2^-9 relative each); a wrong row, column or
    // layout is off by the size of the values.
    assert!(
        worst <= largest / 64.0,
        "largest error {worst} of {largest}"
    );
}

/// `values` rounded to the 16-bit type in place (what the kernel reads and the reference
/// gets), uploaded in that type.
fn upload(client: &Client, values: &mut [f32], dims: [usize; 4], bf16: bool) -> KernelTensor {
    if bf16 {
        let rounded: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
        values
            .iter_mut()
            .zip(&rounded)
            .for_each(|(x, r)| *x = r.to_f32());
        KernelTensor::from_values(client, &rounded, dims)
    } else {
        let rounded: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
        values
            .iter_mut()
            .zip(&rounded)
            .for_each(|(x, r)| *x = r.to_f32());
        KernelTensor::from_values(client, &rounded, dims)
    }
}

/// One case through [`launch_cubes`] (one cube a query block where `resident` is `None`, else
/// that many persistent cubes) against the f64 reference on the same rounded inputs, the
/// outputs poisoned (NaN) before the launch. The output is within 2⁻⁷ of the largest
/// magnitude (at least 1): it is rounded to 16 bits (2⁻⁹) and the probabilities enter the
/// second product in 16 bits (2⁻⁹ each, summed with weights that add to 1); a wrong row,
/// column, key block or mask is off by the size of the values. The log-sum-exp is f32
/// arithmetic on exact products: within 1e-4.
fn check(client: &Client, case: &Case, bf16: bool, resident: Option<usize>, seed: u64) {
    check_inputs(client, case, Inputs::draw(case, seed), bf16, resident);
}

/// [`check`] on these inputs; with a mask (`case.mask`, `[b|1, h|1, sq, sk]`), packed for the
/// kernel's blocks and passed to it, and with a bias (`case.bias`, `[b|1, h|1, sq|1, sk]`),
/// rounded to the inputs' dtype.
fn check_inputs(
    client: &Client,
    case: &Case,
    mut inputs: Inputs,
    bf16: bool,
    resident: Option<usize>,
) {
    crate::testing::poison_outputs(true);
    let q = upload(client, &mut inputs.q, case.q_dims(), bf16);
    let k = upload(client, &mut inputs.k, case.k_dims(), bf16);
    let v = upload(client, &mut inputs.v, case.v_dims(), bf16);
    let params = ScoreParams::new(
        &case.options,
        case.heads,
        case.head_dim,
        case.seq_q,
        case.seq_k,
    );
    let out = output(&q, case.out_dims().into(), q.dtype);
    let lse = output(&q, [case.batch, case.heads, case.seq_q].into(), F32);
    let cfg = WarpgroupConfig {
        persistent: resident.is_some(),
        mask: Switch(case.mask.is_some()),
        key_mask: case.mask.is_some_and(|dims| dims[2] == 1),
        bias: Switch(case.bias.is_some()),
        bias_steps: case
            .bias
            .map_or((false, false), |dims| (dims[0] != 1, dims[1] != 1)),
        batch_inner: batch_inner(case.bias.map(|dims| dims[0]), case.batch),
        ..WarpgroupConfig::new(case.head_dim, params.mask.right, bf16)
    };
    let mask = inputs.mask.as_ref().map(|values| {
        let mask = KernelTensor::from_values(client, values, case.mask.unwrap());
        pack_mask(&mask, cfg.mask_rows(), WarpgroupConfig::BLOCK_KV)
    });
    // The bias rounded to the inputs' dtype, as the reference then reads it.
    let bias = inputs
        .bias
        .as_mut()
        .map(|values| upload(client, values, case.bias.unwrap(), bf16));
    let (expected_out, expected_lse) = inputs.forward(case);
    launch_cubes(
        &q,
        &k,
        &v,
        &out,
        &lse,
        mask.as_ref(),
        bias.as_ref(),
        &params,
        cfg,
        resident,
    );
    let got: Vec<f32> = if bf16 {
        out.read::<half::bf16>()
            .iter()
            .map(|x| x.to_f32())
            .collect()
    } else {
        out.read::<half::f16>().iter().map(|x| x.to_f32()).collect()
    };
    let label = format!(
        "{case:?} bf16={bf16} resident={resident:?} mask={:?} bias={:?}",
        case.mask, case.bias
    );
    assert_close(&format!("{label}: out"), &got, &expected_out, 1.0 / 128.0);
    assert_close(
        &format!("{label}: lse"),
        &lse.read::<f32>(),
        &expected_lse,
        1e-4,
    );
}

#[test]
fn warpgroup_forward_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_forward_matches_the_reference_cuda") else {
        return;
    };
    let top_left = FlashAttentionOptions::new()
        .with_causal(true)
        .with_causal_alignment(CausalAlignment::TopLeft);
    let cases = [
        // Whole blocks, and lengths that end inside a block of queries and of keys.
        (Case::new(2, 3, 256, 256, 64), true),
        (Case::new(2, 4, 300, 300, 64).causal().kv_heads(2), true),
        (Case::new(1, 2, 200, 520, 128), true),
        (Case::new(2, 2, 384, 384, 128).causal().kv_heads(1), true),
        // Bottom-right with more queries than keys: the first rows see no key.
        (Case::new(1, 2, 333, 130, 128).causal(), true),
        (Case::new(1, 2, 150, 700, 64).options(top_left), true),
        (Case::new(1, 2, 260, 260, 64).causal(), false),
        (Case::new(1, 1, 129, 1, 128), false),
    ];
    for (n, (case, bf16)) in cases.iter().enumerate() {
        check(&client, case, *bf16, None, 5000 + n as u64);
    }
}

/// The persistent forward: each of a few cubes walks query blocks of several heads and
/// batches (uneven counts, so that cubes end at different blocks), its query slots and key
/// stages reused across blocks; causal too (the plan keeps it on one cube a block, but the
/// kernel takes it).
#[test]
fn persistent_warpgroup_forward_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("persistent_warpgroup_forward_matches_the_reference_cuda")
    else {
        return;
    };
    let cases = [
        // 2 · 3 · 2 = 12 blocks over 5 cubes; the last block of each head partial.
        (Case::new(2, 3, 300, 300, 64), true, 5),
        // 2 · 4 · 3 = 24 blocks over 7 cubes, GQA, keys ending inside a block.
        (Case::new(2, 4, 384, 520, 128).kv_heads(2), true, 7),
        // One cube walks all 4 blocks.
        (Case::new(1, 2, 256, 130, 128), false, 1),
        // More cubes than blocks.
        (Case::new(1, 1, 129, 200, 64), true, 16),
        // Causal: blocks of different lengths, some rows seeing no key.
        (Case::new(2, 2, 333, 260, 128).causal(), true, 3),
    ];
    for (n, (case, bf16, resident)) in cases.iter().enumerate() {
        check(&client, case, *bf16, Some(*resident), 5100 + n as u64);
    }
}

/// A boolean mask on the Hopper forward (packed into bits): random masks (about a third of the
/// pairs hidden, some broadcast over batches or heads), causal with rows that see no key,
/// document masks, whose query blocks walk only the key blocks from the first they see, and key
/// masks (one row for every query: random and padding), on one cube a block and on persistent
/// cubes.
#[test]
fn masked_warpgroup_forward_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("masked_warpgroup_forward_matches_the_reference_cuda") else {
        return;
    };
    let random = [
        (Case::new(2, 3, 300, 420, 64).mask([2, 3, 300, 420]), None),
        (
            Case::new(2, 4, 260, 520, 128)
                .kv_heads(2)
                .mask([1, 1, 260, 520]),
            Some(5),
        ),
        (
            Case::new(1, 2, 333, 130, 128)
                .causal()
                .mask([1, 2, 333, 130]),
            None,
        ),
        (
            Case::new(2, 2, 400, 400, 64)
                .causal()
                .mask([2, 1, 400, 400]),
            Some(3),
        ),
    ];
    for (n, (case, resident)) in random.iter().enumerate() {
        let inputs = Inputs::draw(case, 5200 + n as u64);
        check_inputs(&client, case, inputs, true, *resident);
    }
    // Documents of 300 rows: a query block past the first document sees none of its keys.
    let documents = [
        (Case::new(2, 2, 700, 700, 128).mask([2, 1, 700, 700]), None),
        (
            Case::new(1, 3, 900, 900, 64)
                .causal()
                .mask([1, 1, 900, 900]),
            Some(4),
        ),
    ];
    for (n, (case, resident)) in documents.iter().enumerate() {
        let mut inputs = Inputs::draw(case, 5300 + n as u64);
        let [mb, mh, sq, sk] = case.mask.unwrap();
        inputs.mask = Some(
            (0..mb * mh * sq * sk)
                .map(|at| {
                    let (i, j) = (at / sk % sq, at % sk);
                    u32::from(i / 300 != j / 300)
                })
                .collect(),
        );
        check_inputs(&client, case, inputs, n == 0, *resident);
    }
    // Key masks (a row of keys for every query): random, per batch or per head; and padding,
    // batch `b`'s last `150 b + 100` keys hidden (whole key blocks past its first ones).
    let keys = [
        (Case::new(2, 3, 300, 420, 64).mask([2, 1, 1, 420]), None),
        (
            Case::new(2, 4, 400, 520, 128)
                .kv_heads(2)
                .causal()
                .mask([1, 4, 1, 520]),
            Some(3),
        ),
    ];
    for (n, (case, resident)) in keys.iter().enumerate() {
        let inputs = Inputs::draw(case, 5500 + n as u64);
        check_inputs(&client, case, inputs, true, *resident);
    }
    let padded = [
        (Case::new(2, 2, 300, 700, 128).mask([2, 1, 1, 700]), None),
        (Case::new(2, 3, 640, 640, 64).mask([2, 1, 1, 640]), Some(4)),
    ];
    for (n, (case, resident)) in padded.iter().enumerate() {
        let mut inputs = Inputs::draw(case, 5600 + n as u64);
        let sk = case.seq_k;
        inputs.mask = Some(
            (0..2 * sk)
                .map(|at| u32::from(at % sk >= sk - (150 * (at / sk) + 100)))
                .collect(),
        );
        check_inputs(&client, case, inputs, n == 0, *resident);
    }
}

/// An additive bias on the Hopper forward (a row per query, keys in whole 16 bytes; planned at
/// head dim 128), copied by a tensor map beside each key block: per pair, one for every batch
/// (the cubes batch-inner, one a block and persistent, plain and causal) or every head, under
/// a causal mask with rows that see no key, beside a mask, and over query and key blocks that
/// cross the sequences' ends.
#[test]
fn biased_warpgroup_forward_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("biased_warpgroup_forward_matches_the_reference_cuda") else {
        return;
    };
    let cases = [
        (
            Case::new(2, 3, 300, 424, 64).bias([1, 3, 300, 424]),
            true,
            None,
        ),
        (
            Case::new(2, 4, 260, 520, 64)
                .kv_heads(2)
                .bias([1, 4, 260, 520]),
            true,
            Some(5),
        ),
        (
            Case::new(2, 2, 200, 336, 128).bias([2, 1, 200, 336]),
            false,
            None,
        ),
        (
            Case::new(1, 2, 333, 136, 128)
                .causal()
                .bias([1, 2, 333, 136]),
            true,
            None,
        ),
        (
            Case::new(2, 2, 333, 136, 64)
                .causal()
                .bias([1, 2, 333, 136]),
            true,
            Some(3),
        ),
        (
            Case::new(2, 2, 400, 400, 64)
                .causal()
                .mask([2, 1, 400, 400])
                .bias([2, 2, 400, 400]),
            true,
            None,
        ),
    ];
    for (n, (case, bf16, resident)) in cases.iter().enumerate() {
        let inputs = Inputs::draw(case, 5400 + n as u64);
        check_inputs(&client, case, inputs, *bf16, *resident);
    }
}

/// One case's gradients through [`backward`] on the warpgroup backward (forced; that it ran is
/// checked), dQ by its atomics or, `deterministic`, by the dQ launch after it (checked too, and
/// a second backward equal bit for bit), after the fused forward, against the f64 reference
/// gradients on the same rounded inputs and output gradient, the gradients poisoned (NaN)
/// before the launches. Within 2⁻⁷ of each gradient's largest magnitude (at least 1): `P` and `dS` enter
/// their products in 16 bits (2⁻⁹ each), the gradients are rounded to 16 bits (2⁻⁹), and
/// `D = rowsum(dO ∘ O)` reads the forward's 16-bit output (2⁻⁹); a wrong row, column, block,
/// mask or scale is off by the size of the values.
fn check_grads(client: &Client, case: &Case, bf16: bool, deterministic: bool, seed: u64) {
    crate::testing::poison_outputs(true);
    let _atomic = (!deterministic).then(crate::testing::force_atomic_dq);
    let _hopper = crate::testing::force_warpgroup_backward();
    let mut inputs = Inputs::draw(case, seed);
    let q = upload(client, &mut inputs.q, case.q_dims(), bf16);
    let k = upload(client, &mut inputs.k, case.k_dims(), bf16);
    let v = upload(client, &mut inputs.v, case.v_dims(), bf16);
    let mut d_out = Rng::new(seed + 1).normals(case.out_dims().iter().product());
    let d_out_tensor = upload(client, &mut d_out, case.out_dims(), bf16);
    let params = ScoreParams::new(
        &case.options,
        case.heads,
        case.head_dim,
        case.seq_q,
        case.seq_k,
    );
    let scores = || ScoreInputs::new(None, None);
    let (out, lse) = forward(q.clone(), k.clone(), v.clone(), scores(), None, params);
    let before = crate::testing::warpgroup_backward_launches();
    let dq_launches = crate::testing::dq_launches();
    let run = || {
        backward(
            q.clone(),
            k.clone(),
            v.clone(),
            scores(),
            out.clone(),
            lse.clone(),
            d_out_tensor.clone(),
            params,
            deterministic,
            false,
        )
    };
    let grads = run();
    assert!(
        crate::testing::warpgroup_backward_launches() > before,
        "{case:?}: the warpgroup backward did not run"
    );
    let (atomic, separate) = crate::testing::dq_launches();
    assert_eq!(
        (atomic > dq_launches.0, separate > dq_launches.1),
        (!deterministic, deterministic),
        "{case:?}: dQ by atomics {}",
        !deterministic
    );
    let read = |t: &KernelTensor| -> Vec<f32> {
        if bf16 {
            t.read::<half::bf16>().iter().map(|x| x.to_f32()).collect()
        } else {
            t.read::<half::f16>().iter().map(|x| x.to_f32()).collect()
        }
    };
    let [dq, dk, dv] = inputs.grads(case, &d_out);
    let label = format!("{case:?} bf16={bf16} deterministic={deterministic}");
    let got = [read(&grads.q), read(&grads.k), read(&grads.v)];
    assert_close(&format!("{label}: dQ"), &got[0], &dq, 1.0 / 128.0);
    assert_close(&format!("{label}: dK"), &got[1], &dk, 1.0 / 128.0);
    assert_close(&format!("{label}: dV"), &got[2], &dv, 1.0 / 128.0);
    if deterministic {
        let again = run();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (name, (first, second)) in ["dQ", "dK", "dV"].iter().zip(got.iter().zip([
            read(&again.q),
            read(&again.k),
            read(&again.v),
        ])) {
            assert!(
                bits(first) == bits(&second),
                "{label}: {name} differs between two deterministic backwards"
            );
        }
    }
}

#[test]
fn warpgroup_backward_matches_the_reference_cuda() {
    let Some(client) = hopper_or_skip("warpgroup_backward_matches_the_reference_cuda") else {
        return;
    };
    let top_left = FlashAttentionOptions::new()
        .with_causal(true)
        .with_causal_alignment(CausalAlignment::TopLeft);
    let cases = [
        // Whole blocks, and lengths that end inside a block of queries and of keys.
        (Case::new(2, 3, 256, 256, 64), true),
        (Case::new(2, 4, 300, 300, 64).causal().kv_heads(2), true),
        (Case::new(1, 2, 200, 520, 128), true),
        (Case::new(2, 4, 384, 384, 128).causal().kv_heads(1), true),
        // Bottom-right with more queries than keys: the first rows see no key.
        (Case::new(1, 2, 333, 130, 128).causal(), true),
        (Case::new(1, 2, 150, 700, 64).options(top_left), true),
        (Case::new(1, 2, 260, 260, 64).causal(), false),
        (Case::new(1, 1, 129, 1, 128), false),
    ];
    for (n, (case, bf16)) in cases.iter().enumerate() {
        check_grads(&client, case, *bf16, false, 6000 + n as u64);
    }
}

/// The warpgroup backward without its atomic dQ (the deterministic dQ's plan: dK and dV alone,
/// dQ by the tensor-core tile's launch after it), bit-for-bit repeatable.
#[test]
fn deterministic_warpgroup_backward_matches_the_reference_cuda() {
    let Some(client) =
        hopper_or_skip("deterministic_warpgroup_backward_matches_the_reference_cuda")
    else {
        return;
    };
    let cases = [
        (Case::new(2, 3, 256, 256, 64), true),
        (Case::new(2, 4, 300, 300, 64).causal().kv_heads(2), true),
        (Case::new(1, 2, 200, 520, 128), true),
        (Case::new(1, 2, 333, 130, 128).causal(), true),
        (Case::new(2, 4, 384, 384, 128).causal().kv_heads(1), false),
    ];
    for (n, (case, bf16)) in cases.iter().enumerate() {
        check_grads(&client, case, *bf16, true, 6100 + n as u64);
    }
}
