//! A first run of the fused attention:
//!
//! ```text
//! cargo run --release --features cuda --example demo
//! ```
//!
//! Runs causal attention on CUDA (bf16) when built with the `cuda` feature and a device is
//! present, otherwise on `burn::backend::Wgpu` (f32; on a machine without a GPU that is lavapipe,
//! a CPU, so the shape is small). Prints which path ran, the error against a naive reference
//! computed on the device (Burn's unfused attention in f32 on the same inputs), and timings.

use std::time::{Duration, Instant};

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::module::attention_fallback;
use burn::tensor::{DType, Distribution, ElementConversion, Tensor};
use burn_flash::{
    FlashAttentionBackend, FlashAttentionOptions, flash_attention, flash_attention_plan,
};

fn main() {
    #[cfg(feature = "cuda")]
    match burn_flash_suite::cuda_device() {
        Ok(device) => {
            // 16k tokens, 16 heads of 128: a FlashAttention-2 benchmark shape.
            demo::<burn::backend::Cuda>(device, "CUDA", DType::BF16, [8, 16, 2048, 128]);
            return;
        }
        Err(reason) => eprintln!("no CUDA device ({reason}); running on wgpu instead\n"),
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("built without the `cuda` feature; running on wgpu\n");

    demo::<Wgpu>(WgpuDevice::default(), "wgpu", DType::F32, [2, 4, 256, 64]);
}

fn demo<B: FlashAttentionBackend>(device: B::Device, name: &str, dtype: DType, dims: [usize; 4]) {
    let [batch, heads, seq, head_dim] = dims;
    println!("device:  {name} ({device:?})");
    println!(
        "inputs:  q, k, v of [batch {batch}, heads {heads}, seq {seq}, head_dim {head_dim}] in {dtype:?}, causal"
    );

    B::seed(&device, 42);
    let [q, k, v] = [(); 3]
        .map(|_| Tensor::<B, 4>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype)));
    let options = FlashAttentionOptions::causal();
    match flash_attention_plan(&q, &k, &v, options) {
        Ok(plan) => println!("path:    {plan}"),
        Err(error) => {
            println!("refused: {error}");
            return;
        }
    }

    // The naive reference: matmul, softmax, matmul in f32, on the same (rounded) inputs.
    let to_f32 = |t: &Tensor<B, 4>| t.clone().cast(DType::F32);
    let reference = attention_fallback(
        to_f32(&q),
        to_f32(&k),
        to_f32(&v),
        None,
        None,
        options.into(),
    );
    eprintln!(
        "(the first calls compile the kernels and autotune Burn's matmuls; this can take a while)"
    );
    let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
    let max_error: f32 = (out.cast(DType::F32) - reference.clone())
        .abs()
        .max()
        .into_scalar()
        .elem();
    let max_ref: f32 = reference.abs().max().into_scalar().elem();
    println!(
        "error:   max |fused - reference| = {max_error:.3e} (max |reference| = {max_ref:.3}); \
         {dtype:?} rounding alone is ~{:.1e} relative",
        match dtype {
            DType::BF16 => 2f32.powi(-8),
            DType::F16 => 2f32.powi(-11),
            _ => f32::EPSILON / 2.0,
        }
    );

    let flops = 4.0 * (batch * heads * seq * seq * head_dim) as f64 / 2.0; // causal: half
    let fused = median_time::<B>(&device, || {
        flash_attention(q.clone(), k.clone(), v.clone(), options)
    });
    let unfused = median_time::<B>(&device, || {
        attention_fallback(q.clone(), k.clone(), v.clone(), None, None, options.into())
    });
    let report = |label: &str, time: Duration| {
        let ms = time.as_secs_f64() * 1e3;
        println!(
            "time:    {label} {ms:9.3} ms  {:8.3} TFLOPS",
            flops / ms / 1e9
        );
    };
    report("burn-flash (fused)      ", fused);
    report("Burn attention_fallback ", unfused);
    println!(
        "ratio:   unfused time / fused time = {:.2} (medians of 10 calls)",
        unfused.as_secs_f64() / fused.as_secs_f64()
    );
}

/// Median wall time of 10 synchronised calls, after 3 untimed ones.
fn median_time<B: FlashAttentionBackend>(
    device: &B::Device,
    call: impl Fn() -> Tensor<B, 4>,
) -> Duration {
    let mut times: Vec<Duration> = (0..13)
        .map(|_| {
            let start = Instant::now();
            let out = call();
            B::sync(device).expect("device sync");
            let elapsed = start.elapsed();
            drop(out);
            elapsed
        })
        .skip(3)
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}
