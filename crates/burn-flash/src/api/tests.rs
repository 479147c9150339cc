//! The API on wgpu (lavapipe in CI): validation, the no-launch cases, the fused path on the
//! plain and the autodiff device, the fallback. Small shapes: it may be a CPU.

use burn::tensor::module::attention_fallback;
use burn::tensor::{DType, Device, Distribution, Tensor};

use crate::{
    FlashAttentionError, FlashAttentionOptions, FlashAttentionPlan, TilePath, flash_attention,
    flash_attention_plan, flash_attention_with_lse, try_flash_attention,
};

fn wgpu() -> Device {
    Device::wgpu(Default::default())
}

fn random(dims: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::random(dims, Distribution::Normal(0.0, 1.0), device)
}

fn max_diff(a: Tensor<4>, b: Tensor<4>) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let diff: f32 = (a - b).abs().max().into_scalar();
    assert!(!diff.is_nan(), "NaN in the output");
    diff
}

/// Few distinct kernel configurations (head dims, causal): each one compiles, slowly on a CPU.
const CASES: [(usize, usize, usize, usize, usize, usize, bool); 5] = [
    // batch, heads, seq_q, seq_k, head_dim, value_dim, causal
    (1, 1, 1, 1, 64, 64, false),
    (2, 3, 17, 17, 64, 64, true),
    (1, 2, 9, 40, 64, 64, true),
    (1, 2, 40, 9, 64, 64, true),
    (2, 1, 33, 65, 32, 16, false),
];

fn matches_fallback(device: &Device, cases: &[(usize, usize, usize, usize, usize, usize, bool)]) {
    let device = device.clone();
    device.seed(7);
    crate::testing::poison_outputs(true);
    for &(batch, heads, seq_q, seq_k, dim, value_dim, causal) in cases {
        let q = random([batch, heads, seq_q, dim], &device);
        let k = random([batch, heads, seq_k, dim], &device);
        let v = random([batch, heads, seq_k, value_dim], &device);
        let options = FlashAttentionOptions::new().with_causal(causal);
        let plan = flash_attention_plan(&q, &k, &v, options).unwrap();
        assert_eq!(plan, FlashAttentionPlan::Fused(TilePath::Portable));
        let expected =
            attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into());
        let got = flash_attention(q, k, v, options);
        let diff = max_diff(got, expected);
        assert!(
            diff < 1e-4,
            "{batch}x{heads} q {seq_q} k {seq_k} d {dim}/{value_dim} causal {causal}: {diff}"
        );
    }
    crate::testing::poison_outputs(false);
}

#[test]
fn fused_matches_fallback() {
    matches_fallback(&wgpu(), &CASES);
}

/// On an autodiff device the forward goes through the autodiff backend's node.
#[test]
fn fused_matches_fallback_on_the_autodiff_device() {
    matches_fallback(&wgpu().autodiff(), &CASES[..2]);
}

/// Views that are not contiguous, as multi-head attention makes them (`[b, n, h, d]`
/// projections with heads and sequence swapped, a transposed value): the launch makes them
/// contiguous first.
#[test]
fn strided_inputs_are_made_contiguous() {
    let device = wgpu();
    device.seed(9);
    let heads_second = |dims| random(dims, &device).swap_dims(1, 2);
    let q = heads_second([2, 37, 3, 64]);
    let k = heads_second([2, 45, 3, 64]);
    let v = random([2, 3, 64, 45], &device).swap_dims(2, 3);
    let options = FlashAttentionOptions::causal();
    assert!(
        flash_attention_plan(&q, &k, &v, options)
            .unwrap()
            .is_fused()
    );
    let expected = attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into());
    let got = flash_attention(q, k, v, options);
    assert!(max_diff(got, expected) < 1e-4);
}

#[test]
fn custom_scale_is_used() {
    let device = wgpu();
    let (q, k, v) = (
        random([1, 2, 8, 64], &device),
        random([1, 2, 8, 64], &device),
        random([1, 2, 8, 64], &device),
    );
    let options = FlashAttentionOptions::causal().with_scale(0.7);
    let expected = attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into());
    assert!(max_diff(flash_attention(q, k, v, options), expected) < 1e-4);
}

#[test]
fn lse_is_f32_and_shaped_per_row() {
    let device = wgpu();
    let q = random([2, 3, 5, 64], &device);
    let (_, lse) =
        flash_attention_with_lse(q.clone(), q.clone(), q, FlashAttentionOptions::default());
    assert_eq!(lse.dims(), [2, 3, 5]);
    assert_eq!(lse.dtype(), DType::F32);
    let values = lse.to_data().try_to_vec::<f32>().unwrap();
    assert!(values.iter().all(|x| x.is_finite()));
}

#[test]
fn unsupported_head_dim_falls_back() {
    let device = wgpu();
    let (q, k, v) = (
        random([1, 1, 4, 288], &device),
        random([1, 1, 6, 288], &device),
        random([1, 1, 6, 288], &device),
    );
    let options = FlashAttentionOptions::causal();
    let plan = flash_attention_plan(&q, &k, &v, options).unwrap();
    assert!(matches!(plan, FlashAttentionPlan::Fallback(_)), "{plan}");
    let expected = attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into());
    assert_eq!(max_diff(flash_attention(q, k, v, options), expected), 0.0);
}

#[test]
fn no_keys_or_empty_output_give_zeros() {
    let device = wgpu();
    let q = random([2, 3, 5, 16], &device);
    let k = Tensor::<4>::zeros([2, 3, 0, 16], &device);
    let v = Tensor::<4>::zeros([2, 3, 0, 8], &device);
    let options = FlashAttentionOptions::causal();
    assert_eq!(
        flash_attention_plan(&q, &k, &v, options),
        Ok(FlashAttentionPlan::Zeros)
    );
    let out = flash_attention(q, k, v, options);
    assert_eq!(out.dims(), [2, 3, 5, 8]);
    assert_eq!(out.abs().sum().into_scalar::<f32>(), 0.0);

    let q = Tensor::<4>::zeros([0, 3, 5, 16], &device);
    let k = Tensor::<4>::zeros([0, 3, 7, 16], &device);
    let v = Tensor::<4>::zeros([0, 3, 7, 16], &device);
    assert_eq!(flash_attention(q, k, v, options).dims(), [0, 3, 5, 16]);
}

#[test]
fn zero_head_dim_averages_the_visible_values() {
    let device = wgpu();
    let q = Tensor::<4>::zeros([1, 1, 3, 0], &device);
    let k = Tensor::<4>::zeros([1, 1, 3, 0], &device);
    let v = Tensor::<4>::from_floats([[[[3.0], [6.0], [9.0]]]], &device);
    let out = flash_attention(q, k, v, FlashAttentionOptions::causal());
    let expected = Tensor::<4>::from_floats([[[[3.0], [4.5], [6.0]]]], &device);
    assert!(max_diff(out, expected) < 1e-6);
}

#[test]
fn invalid_inputs_are_refused() {
    let device = wgpu();
    let t = |dims: [usize; 4]| Tensor::<4>::zeros(dims, &device);
    let run = |q: [usize; 4], k: [usize; 4], v: [usize; 4]| {
        try_flash_attention(t(q), t(k), t(v), FlashAttentionOptions::default()).unwrap_err()
    };
    assert_eq!(
        run([1, 2, 4, 8], [2, 2, 4, 8], [1, 2, 4, 8]),
        FlashAttentionError::BatchMismatch { q: 1, k: 2, v: 1 }
    );
    assert_eq!(
        run([1, 2, 4, 8], [1, 2, 4, 8], [1, 1, 4, 8]),
        FlashAttentionError::HeadsMismatch { q: 2, k: 2, v: 1 }
    );
    assert_eq!(
        run([1, 2, 4, 8], [1, 2, 4, 16], [1, 2, 4, 8]),
        FlashAttentionError::HeadDimMismatch { q: 8, k: 16 }
    );
    assert_eq!(
        run([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 5, 8]),
        FlashAttentionError::KeyValueLengthMismatch { k: 4, v: 5 }
    );
    for scale in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
        let options = FlashAttentionOptions::new().with_scale(scale);
        let error = try_flash_attention(t([1, 1, 2, 4]), t([1, 1, 2, 4]), t([1, 1, 2, 4]), options)
            .unwrap_err();
        assert!(
            matches!(error, FlashAttentionError::InvalidScale(_)),
            "{error}"
        );
    }
    if device.supports_dtype(DType::F16) {
        let half = t([1, 1, 2, 4]).cast(DType::F16);
        let error = try_flash_attention(
            t([1, 1, 2, 4]),
            half,
            t([1, 1, 2, 4]),
            FlashAttentionOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(error, FlashAttentionError::DTypeMismatch { .. }),
            "{error}"
        );
    }
}

#[test]
#[should_panic(expected = "q and k must have the same head dim")]
fn flash_attention_panics_with_the_error_message() {
    let device = wgpu();
    let q = Tensor::<4>::zeros([1, 1, 2, 4], &device);
    let k = Tensor::<4>::zeros([1, 1, 2, 8], &device);
    flash_attention(q, k.clone(), k, FlashAttentionOptions::default());
}

/// `flash_attention_with_lse` on head dims it pads (forced on the portable tile here): the
/// output keeps the value head dim, and output and log-sum-exp are those of the unpadded call
/// (the padded columns add zeros to every score), not those of a head dim 64 scale.
#[test]
fn padded_head_dims_keep_the_output_and_lse() {
    let device = wgpu();
    let (q, k, v) = (
        random([1, 2, 9, 48], &device),
        random([1, 2, 21, 48], &device),
        random([1, 2, 21, 24], &device),
    );
    let options = FlashAttentionOptions::causal();
    let (out, lse) = flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options);
    let padded = crate::testing::pad_head_dims();
    assert_eq!(
        flash_attention_plan(&q, &k, &v, options).unwrap(),
        FlashAttentionPlan::FusedPadded {
            tile: TilePath::Portable,
            head_dim: 64,
            value_dim: 32
        }
    );
    let (padded_out, padded_lse) = flash_attention_with_lse(q, k, v, options);
    drop(padded);
    assert_eq!(padded_out.dims(), [1, 2, 9, 24]);
    assert!(max_diff(padded_out, out) < 1e-5);
    let lse_diff: f32 = (padded_lse - lse).abs().max().into_scalar();
    assert!(lse_diff < 1e-5, "log-sum-exp differs by {lse_diff}");
}

/// Keys and values that are a prefix of longer sequences (the filled part of a cache) reach
/// the kernel as views and are read in place, without a copy.
#[test]
fn cache_prefixes_are_read_in_place() {
    let device = wgpu();
    device.seed(11);
    let q = random([2, 2, 3, 32], &device);
    let cache = |dim| random([2, 2, 64, dim], &device);
    let (k_cache, v_cache) = (cache(32), cache(16));
    let k = k_cache.slice([0..2, 0..2, 0..40]);
    let v = v_cache.slice([0..2, 0..2, 0..40]);
    let options = FlashAttentionOptions::causal();
    let expected = attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into());
    let views = crate::testing::views_read_in_place();
    let got = flash_attention(q, k, v, options);
    assert!(max_diff(got, expected) < 1e-4);
    assert_eq!(crate::testing::views_read_in_place(), views + 2);
}
