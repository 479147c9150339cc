//! Launch of the forward: the plan for these inputs on this device ([`plan`](super::plan)),
//! then the outputs allocated, the mask packed where the plan says, and the kernel enqueued.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::prelude::*;

use super::kernel::flash_forward;
use super::plan::{ForwardPlan, ForwardProblem};
use crate::kernel::config::{ScoreParams, TilePath};
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::{cube_count, cube_dim};
use crate::kernel::pack::pack_mask;
use crate::kernel::tensors::{ScoreInputs, address_type, output, stage_map, tma_aligned};
use crate::kernel::tile::{MmaTile, PortableTile};

/// Decide whether the fused forward can run inputs of this dtype and head dims on this client,
/// and with which tile. `Err` carries the reason the caller logs before taking the fallback.
pub fn support<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    super::plan::support(&DeviceCaps::of(client, dtype), dtype, head_dim, value_dim)
}

/// Run the fused forward. `q: [b, h, sq, d]`, `k: [b, hkv, sk, d]`, `v: [b, hkv, sk, dv]` (`h`
/// a multiple of `hkv`), on one device with one dtype, accepted by [`support`]; the optional
/// boolean `mask` (`true` hides) and additive `bias` (the inputs' dtype) are
/// `[b|1, h|1, sq|1, sk]`. Returns the output `[b, h, sq, dv]` in the input dtype and the
/// log-sum-exp `[b, h, sq]` in f32 (natural log of Σ exp(scale·s + bias) over the visible keys,
/// `s` softcapped; `-inf` for rows that see no key, whose output is 0).
pub fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    inputs: ScoreInputs<R>,
    params: ScoreParams,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let params = params.with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let value_dim = v.meta.shape()[3];
    let client = q.client.clone();

    let problem = ForwardProblem {
        dtype: q.dtype,
        batch,
        head_dim,
        value_dim,
        params,
        inputs: inputs.facts(),
        kv_tma_aligned: tma_aligned(&k) && tma_aligned(&v),
    };
    let plan = ForwardPlan::new(&DeviceCaps::of(&client, q.dtype), &problem)
        .unwrap_or_else(|reason| panic!("fused attention launched on unsupported input: {reason}"));
    log::debug!("fused forward: {plan}");
    let ForwardPlan {
        cfg,
        pack_mask: packs,
    } = plan;
    let out = output(&q, Shape::new([batch, heads, seq_q, value_dim]), q.dtype);
    let lse = output(&q, Shape::new([batch, heads, seq_q]), DType::F32);
    if out.meta.num_elements() == 0 {
        return (out, lse);
    }

    let (inputs, hidden_blocks) = match (packs, &inputs.mask) {
        (true, Some(mask)) => {
            let packed = pack_mask(mask, cfg.block_q, cfg.block_kv);
            let inputs = ScoreInputs {
                mask: Some(packed.words),
                ..inputs
            };
            (inputs, Some(packed.hidden_blocks))
        }
        _ => (inputs, None),
    };
    if cfg.tma {
        crate::testing::record_tma_launch();
    }
    let (k_map, v_map) = (stage_map(&k, &cfg), stage_map(&v, &cfg));
    let cube_dim = cube_dim(&cfg);
    let cube_count = cube_count(&cfg, seq_q, heads, batch);
    // The score inputs can be the largest tensors of the launch (`[b, h, sq, sk]`).
    let address = address_type(&[&q, &k, &v, &out])
        .max(inputs.address_type())
        .max(address_type(&hidden_blocks.iter().collect::<Vec<_>>()));
    let dtypes = [q.dtype.into(), inputs.mask_dtype()];
    let (seed_lo, seed_hi, threshold) = params.dropout_args();

    // SAFETY: shapes and strides were validated by the caller; every index the kernel forms is
    // bounded by the tensors' shapes, and out-of-range rows are clamped or zero-filled.
    macro_rules! launch {
        ($tile:ty) => {
            unsafe {
                flash_forward::launch_unchecked::<$tile, R>(
                    &client,
                    cube_count,
                    cube_dim,
                    address,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    k_map.into(),
                    v_map.into(),
                    inputs.mask_arg().into(),
                    hidden_blocks.map(CubeTensor::into_tensor_arg).into(),
                    inputs.bias_arg().into(),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    params.scale,
                    params.left,
                    params.right,
                    params.softcap.unwrap_or(1.0),
                    f32::NEG_INFINITY,
                    seed_lo,
                    seed_hi,
                    threshold,
                    params.alibi_pow2.unwrap_or(1),
                    cfg,
                    dtypes,
                )
            }
        };
    }
    // The portable tile never stages by tensor maps: its maps are `None`.
    match cfg.tile {
        TilePath::TensorCore => launch!(MmaTile),
        TilePath::Portable => launch!(PortableTile),
    }
    (out, lse)
}

#[cfg(test)]
mod tests {
    //! Kernel-level smoke test on the bare wgpu backend (lavapipe in CI): the portable tile
    //! against a plain CPU computation. The public API is tested at the workspace root.
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use burn_cubecl::CubeBackend;

    use crate::kernel::config::ScoreParams;
    use crate::kernel::tensors::ScoreInputs;
    use crate::options::FlashAttentionOptions;

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        sq: usize,
        sk: usize,
        d: usize,
        causal: bool,
    ) -> Vec<f64> {
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0; sq * d];
        for i in 0..sq {
            let visible = |j: usize| !causal || j + sq <= i + sk;
            let s: Vec<f64> = (0..sk)
                .map(|j| {
                    (0..d)
                        .map(|c| q[i * d + c] as f64 * k[j * d + c] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = (0..sk)
                .filter(|&j| visible(j))
                .map(|j| s[j])
                .fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = (0..sk)
                .map(|j| if visible(j) { (s[j] - m).exp() } else { 0.0 })
                .collect();
            let l: f64 = p.iter().sum();
            for c in 0..d {
                out[i * d + c] = if l > 0.0 {
                    (0..sk).map(|j| p[j] * v[j * d + c] as f64).sum::<f64>() / l
                } else {
                    0.0
                };
            }
        }
        out
    }

    #[test]
    fn portable_forward_matches_cpu() {
        let device = WgpuDevice::default();
        crate::testing::poison_outputs(true);
        for &(sq, sk, d, causal) in &[
            (1, 1, 64, false),
            (1, 2, 64, false),
            (2, 2, 64, false),
            (7, 7, 64, false),
            (65, 33, 64, true),
            (33, 70, 128, true),
        ] {
            let q = Tensor::<B, 4>::random([1, 1, sq, d], Distribution::Normal(0.0, 1.0), &device);
            let k = Tensor::<B, 4>::random([1, 1, sk, d], Distribution::Normal(0.0, 1.0), &device);
            let v = Tensor::<B, 4>::random([1, 1, sk, d], Distribution::Normal(0.0, 1.0), &device);
            let data = |t: &Tensor<B, 4>| t.to_data().to_vec::<f32>().unwrap();
            let expected = reference(&data(&q), &data(&k), &data(&v), sq, sk, d, causal);
            let options = FlashAttentionOptions::new().with_causal(causal);
            let (out, _lse) = super::forward(
                q.into_primitive().tensor(),
                k.into_primitive().tensor(),
                v.into_primitive().tensor(),
                ScoreInputs::new(None, None),
                ScoreParams::new(&options, 1, d, sq, sk),
            );
            let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
            let got = out.to_data().to_vec::<f32>().unwrap();
            let err = got
                .iter()
                .zip(&expected)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                err < 1e-4,
                "sq {sq} sk {sk} d {d} causal {causal}: max error {err}"
            );
        }
    }
}
