//! Warpgroup matrix products (`wgmma.mma_async`, SM90a): the instruction the Hopper tile is to
//! be built on. CubeCL 0.12 lowers its own `wgmma` API only on its LLVM code path, and this
//! crate compiles CUDA through the C++ one (for `cp.async`), so the products are inline PTX.
//! One `gpu_asm!` holds a product's fence, every k-step and the commit: ptxas serialises
//! products whose k-steps are split over several (nvcc 13, H200). The 32 accumulators a unit
//! holds of a 64 × 64 f32 tile come out as one vector (a `gpu_asm!` has one output). Not yet
//! used by the kernels: the tests below check the forward's two products on the GPU, `S = Q · Kᵀ`
//! from shared memory and `O + P · V` with `P` in the registers `S` came out in.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::generic_to_shared;

/// The 32 f32 accumulators one unit of a warpgroup holds of a 64 × 64 tile.
pub type Accumulators = Vector<f32, Const<32>>;

/// Where element `(row, col)` of a tile of 16-bit values 64 columns wide (128 bytes a row)
/// lies in shared memory with the 128-byte swizzle: the 16-byte chunk `c` of row `r` at chunk
/// `c ^ (r % 8)`, the layout a tensor map's `B128` swizzle writes and the descriptors below
/// read. The tile must start on a 1024-byte boundary.
#[cube]
pub fn swizzled(row: usize, col: usize) -> usize {
    row * 64 + (((col / 8) ^ (row % 8)) * 8) + col % 8
}

/// The matrix descriptor of a tile of 16-bit values in shared memory, K-major (64 values of
/// the reduced dim a row), [`swizzled`], starting at `tile`'s first element: its shared
/// address in 16-byte units, 1024 bytes from one group of 8 rows to the next, the 128-byte
/// swizzle. A k-step of 16 values further is 2 more (32 bytes).
#[cube]
pub fn descriptor<E: CubePrimitive>(tile: &Shared<[E]>) -> u64 {
    let address = u64::cast_from(generic_to_shared::<E>(tile.as_ptr()));
    // Leading byte offset 1 (unused with the swizzle), stride byte offset 1024 / 16, mode 1.
    ((address >> 4) & 0x3FFF) | (1u64 << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// `S = A · Bᵀ` over 64 values of the reduced dim, bf16 in and f32 out, for the 64 × 64 tile
/// of the warpgroup (its 128 units call it together): `a` and `b` the [`descriptor`]s of the
/// 64 rows of A and of B. Issued, not finished: [`wait_products`] before reading the result.
#[cube]
pub fn product_bf16_64x64x64(a: u64, b: u64) -> Accumulators {
    let body = comptime![shared_product_ptx(
        64,
        &k_major_steps(64, 4),
        &k_major_steps(64, 4)
    )];
    let d: Accumulators;
    gpu_asm!("{body}", "// {d} {a} {b}", d = out(_) d, a = in(_) a, b = in(_) b);
    d
}

/// The matrix descriptor of a tile of 16-bit values read across its rows (the B operand
/// transposed: rows of the reduced dim, 64 values of the other each), [`swizzled`], starting at
/// `tile`'s first element. Both offsets are the 1024 bytes from one group of 8 rows to the next:
/// the 64 columns are one swizzle pattern wide, so the offset between patterns along them is
/// never used. A k-step of 16 rows further is 128 more (2048 bytes).
#[cube]
pub fn descriptor_across_rows<E: CubePrimitive>(tile: &Shared<[E]>) -> u64 {
    let address = u64::cast_from(generic_to_shared::<E>(tile.as_ptr()));
    ((address >> 4) & 0x3FFF) | ((1024u64 >> 4) << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// Registers of A a unit holds for one `product_pv_*`: four 32-bit registers (two 16-bit
/// values each) per k-step of 16, four k-steps.
pub type Fragment = Vector<u32, Const<16>>;

/// `O + P · V` for the 64 × 64 tile of the warpgroup over 64 keys, bf16 in and f32 out: `o`
/// the accumulators, `p` the probabilities in registers ([`fragment_position`]), `v` the
/// [`descriptor_across_rows`] of the 64 key rows of V (64 values each). Issued, not
/// finished: [`wait_products`] before reading the result. The accumulators pass in and out as
/// separate operands (a `gpu_asm!` operand is one or the other), copied at the start.
#[cube]
pub fn product_pv_bf16_64x64x64(o: Accumulators, p: Fragment, v: u64) -> Accumulators {
    let body = comptime![register_product_ptx(64, &across_rows_steps(4))];
    let d: Accumulators;
    gpu_asm!(
        "{body}",
        "// {d} {o} {p} {v}",
        d = out(_) d,
        // Read as values: a `gpu_asm!` input takes a mutable local by its address.
        o = in(_) Accumulators::reinterpret(o),
        p = in(_) Fragment::reinterpret(p),
        v = in(_) v,
    );
    d
}

/// Each k-step's offset, in 16-byte units, in a K-major [`descriptor`] of `rows` rows: 32 bytes
/// a step within a 64-column panel, a panel (`rows` × 128 bytes) for each 4 steps.
fn k_major_steps(rows: u64, steps: u64) -> Vec<u64> {
    (0..steps).map(|s| s / 4 * rows * 8 + s % 4 * 2).collect()
}

/// Each k-step's offset, in 16-byte units, in a [`descriptor_across_rows`]: 16 rows of 128
/// bytes a step.
fn across_rows_steps(steps: u64) -> Vec<u64> {
    (0..steps).map(|s| s * 128).collect()
}

/// `count` registers from `%first` as a PTX vector operand.
fn registers(first: usize, count: usize) -> String {
    let list: Vec<String> = (first..first + count).map(|r| format!("%{r}")).collect();
    format!("{{{}}}", list.join(", "))
}

/// One `m64n{n}k16` step, bf16 in and f32 out, into the accumulators `d`.
fn mma_step(n: usize, d: &str, a: &str, b: &str, scale_d: &str, immediates: &str) -> String {
    format!(
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {d}, {a}, {b}, {scale_d}, {immediates};"
    )
}

/// The PTX of a warpgroup product with both operands in shared memory, `D = A · B` over one
/// k-step per entry of `a_steps` / `b_steps` (the descriptors' offsets, the first 0): the fence,
/// the steps (the first overwriting `D`), the commit. Its operands as CubeCL numbers them: the
/// `n / 2` accumulators out (`%0..`), A's descriptor, B's.
fn shared_product_ptx(n: usize, a_steps: &[u64], b_steps: &[u64]) -> String {
    assert!(a_steps.len() == b_steps.len() && a_steps[0] == 0 && b_steps[0] == 0);
    let d = registers(0, n / 2);
    let (a, b) = (format!("%{}", n / 2), format!("%{}", n / 2 + 1));
    let mut lines: Vec<String> = [
        "{",
        ".reg .pred fresh, add;",
        ".reg .b32 zero;",
        ".reg .b64 da, db;",
        "mov.b32 zero, 0;",
        "setp.ne.b32 fresh, zero, 0;",
        "setp.eq.b32 add, zero, 0;",
        "wgmma.fence.sync.aligned;",
    ]
    .map(String::from)
    .into();
    lines.push(mma_step(n, &d, &a, &b, "fresh", "1, 1, 0, 0"));
    for (da, db) in a_steps.iter().zip(b_steps).skip(1) {
        lines.push(format!("add.s64 da, {a}, {da};"));
        lines.push(format!("add.s64 db, {b}, {db};"));
        lines.push(mma_step(n, &d, "da", "db", "add", "1, 1, 0, 0"));
    }
    lines.extend(["wgmma.commit_group.sync.aligned;", "}"].map(String::from));
    lines.join("\n")
}

/// The PTX of a warpgroup product with A in registers, `D = C + A · Bᵀ`, B read across its
/// rows, over one k-step per entry of `b_steps` (the descriptor's offsets, the first 0): `C`
/// copied to `D`, the fence, the steps, the commit. Its operands as CubeCL numbers them: the
/// `n / 2` accumulators out (`%0..`), the `n / 2` in, A's 4 registers a step, B's descriptor.
fn register_product_ptx(n: usize, b_steps: &[u64]) -> String {
    assert!(b_steps[0] == 0);
    let (half, steps) = (n / 2, b_steps.len());
    let d = registers(0, half);
    let b = format!("%{}", n + 4 * steps);
    let mut lines: Vec<String> = [
        "{",
        ".reg .pred add;",
        ".reg .b32 zero;",
        ".reg .b64 dv;",
        "mov.b32 zero, 0;",
        "setp.eq.b32 add, zero, 0;",
    ]
    .map(String::from)
    .into();
    lines.extend((0..half).map(|i| format!("mov.b32 %{i}, %{};", half + i)));
    lines.push("wgmma.fence.sync.aligned;".into());
    for (step, offset) in b_steps.iter().enumerate() {
        let a = registers(n + 4 * step, 4);
        if step == 0 {
            lines.push(mma_step(n, &d, &a, &b, "add", "1, 1, 1"));
        } else {
            lines.push(format!("add.s64 dv, {b}, {offset};"));
            lines.push(mma_step(n, &d, &a, "dv", "add", "1, 1, 1"));
        }
    }
    lines.extend(["wgmma.commit_group.sync.aligned;", "}"].map(String::from));
    lines.join("\n")
}

/// Wait for every product this warpgroup issued.
#[cube]
pub fn wait_products() {
    gpu_asm!("wgmma.wait_group.sync.aligned 0;");
}

/// Row and column of accumulator `nth` of unit `unit` (0..128) in the 64 × 64 tile: warp `w`
/// holds rows `16w..16w + 16`; within it as `mma.sync`'s m16n8 accumulators, one per 8 columns.
#[cube]
pub fn position(unit: usize, #[comptime] nth: usize) -> (usize, usize) {
    let (warp, lane) = (unit / 32, unit % 32);
    let row = warp * 16 + lane / 4 + comptime!((nth % 4) / 2 * 8);
    let col = comptime!(nth / 4 * 8) + (lane % 4) * 2 + comptime!(nth % 2);
    (row, col)
}

/// Row and column of the first of the two values register `nth` of a unit's [`Fragment`]
/// packs (the second is the next column): as `mma.sync`'s m16n8k16 A operand per warp and
/// k-step, so that the accumulators of `S` at [`position`] are the values of `P` here.
#[cube]
pub fn fragment_position(unit: usize, #[comptime] nth: usize) -> (usize, usize) {
    let (warp, lane) = (unit / 32, unit % 32);
    let row = warp * 16 + lane / 4 + comptime!(nth % 2 * 8);
    let col = comptime!(nth / 4 * 16 + (nth % 4) / 2 * 8) + (lane % 4) * 2;
    (row, col)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::device::DeviceCaps;
    use crate::kernel::tensors::{BF16, KernelTensor};
    use crate::kernel::tests::Rng;

    /// One warpgroup: A and B (64 × 64, rows of the reduced dim) staged swizzled, their
    /// product by four k-steps, the accumulators written out by [`position`].
    #[cube(launch_unchecked)]
    fn product_probe<E: Float>(
        a: &Tensor<E>,
        b: &Tensor<E>,
        out: &mut Tensor<f32>,
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
        let d = product_bf16_64x64x64(descriptor::<E>(&a_tile), descriptor::<E>(&b_tile));
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
        let d = product_pv_bf16_64x64x64(acc, fragment, descriptor_across_rows::<E>(&v_tile));
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
            let s = product_bf16_64x64x64(descriptor::<E>(&q_tile), descriptor::<E>(&k_tile));
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
            o = product_pv_bf16_64x64x64(o, fragment, descriptor_across_rows::<E>(&v_tile));
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

    #[test]
    fn warpgroup_product_matches_the_reference_cuda() {
        let Some(client) = hopper_or_skip("warpgroup_product_matches_the_reference_cuda") else {
            return;
        };
        let mut rng = Rng::new(50);
        let (a, b) = (bf16s(&mut rng), bf16s(&mut rng));
        let out = KernelTensor::from_f32(&client, &[f32::NAN; 64 * 64], [64, 64]);
        let [a_dev, b_dev] = [&a, &b].map(|v| KernelTensor::from_values(&client, v, [64, 64]));
        // SAFETY: one cube of 128 units, each reading its 32 of the 4096 inputs and writing its
        // 32 of the 4096 outputs.
        unsafe {
            product_probe::launch_unchecked(
                &client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(128),
                a_dev.into_tensor_arg(),
                b_dev.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                BF16,
            );
        }
        // A · Bᵀ: row i of A against row j of B.
        check_product("A B^T", &out.read::<f32>(), |i, j| {
            let terms = (0..64).map(|k| a[i * 64 + k].to_f64() * b[j * 64 + k].to_f64());
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

    /// The PTX of the two products as CubeCL printed it for the kernels whose tests passed on
    /// an NVIDIA H200 on 2026-11-29 (written out by hand then, `docs/hopper.md`), comment
    /// lines left out: the generators must give it back exactly, so that the checked products
    /// stay the ones checked.
    const CHECKED_SHARED_PRODUCT: &str = r#"{
.reg .pred fresh, add;
.reg .b32 zero;
.reg .b64 da, db;
mov.b32 zero, 0;
setp.ne.b32 fresh, zero, 0;
setp.eq.b32 add, zero, 0;
wgmma.fence.sync.aligned;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, fresh, 1, 1, 0, 0;
add.s64 da, %32, 2;
add.s64 db, %33, 2;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
add.s64 da, %32, 4;
add.s64 db, %33, 4;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
add.s64 da, %32, 6;
add.s64 db, %33, 6;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
wgmma.commit_group.sync.aligned;
}"#;
    const CHECKED_REGISTER_PRODUCT: &str = r#"{
.reg .pred add;
.reg .b32 zero;
.reg .b64 dv;
mov.b32 zero, 0;
setp.eq.b32 add, zero, 0;
mov.b32 %0, %32;
mov.b32 %1, %33;
mov.b32 %2, %34;
mov.b32 %3, %35;
mov.b32 %4, %36;
mov.b32 %5, %37;
mov.b32 %6, %38;
mov.b32 %7, %39;
mov.b32 %8, %40;
mov.b32 %9, %41;
mov.b32 %10, %42;
mov.b32 %11, %43;
mov.b32 %12, %44;
mov.b32 %13, %45;
mov.b32 %14, %46;
mov.b32 %15, %47;
mov.b32 %16, %48;
mov.b32 %17, %49;
mov.b32 %18, %50;
mov.b32 %19, %51;
mov.b32 %20, %52;
mov.b32 %21, %53;
mov.b32 %22, %54;
mov.b32 %23, %55;
mov.b32 %24, %56;
mov.b32 %25, %57;
mov.b32 %26, %58;
mov.b32 %27, %59;
mov.b32 %28, %60;
mov.b32 %29, %61;
mov.b32 %30, %62;
mov.b32 %31, %63;
wgmma.fence.sync.aligned;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%64, %65, %66, %67}, %80, add, 1, 1, 1;
add.s64 dv, %80, 128;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%68, %69, %70, %71}, dv, add, 1, 1, 1;
add.s64 dv, %80, 256;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%72, %73, %74, %75}, dv, add, 1, 1, 1;
add.s64 dv, %80, 384;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%76, %77, %78, %79}, dv, add, 1, 1, 1;
wgmma.commit_group.sync.aligned;
}"#;

    #[test]
    fn generated_ptx_is_the_checked_ptx() {
        assert_eq!(
            shared_product_ptx(64, &k_major_steps(64, 4), &k_major_steps(64, 4)),
            CHECKED_SHARED_PRODUCT
        );
        assert_eq!(
            register_product_ptx(64, &across_rows_steps(4)),
            CHECKED_REGISTER_PRODUCT
        );
        // Head dim 128: the fifth k-step starts the second 64-column panel of 64 rows.
        assert_eq!(k_major_steps(64, 8), [0, 2, 4, 6, 512, 514, 516, 518]);
    }
}
