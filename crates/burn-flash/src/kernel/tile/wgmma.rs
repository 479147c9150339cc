//! Warpgroup matrix products (`wgmma.mma_async`, SM90a): the instruction the Hopper tile is to
//! be built on. CubeCL 0.12 lowers its own `wgmma` API only on its LLVM code path, and this
//! crate compiles CUDA through the C++ one (for `cp.async`), so the products are inline PTX.
//! One `gpu_asm!` holds a product's fence, every k-step and the commit: ptxas serialises
//! products whose k-steps are split over several. The 32 accumulators a unit holds of a
//! 64 × 64 f32 tile come out as one vector (a `gpu_asm!` has one output). Not yet used by the
//! kernels: the test below checks the instruction, the shared-memory descriptors and the
//! accumulators' layout on the GPU.

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
    let d: Accumulators;
    gpu_asm!(
        "{{",
        ".reg .pred fresh, add;",
        ".reg .b32 zero;",
        ".reg .b64 da, db;",
        "mov.b32 zero, 0;",
        "setp.ne.b32 fresh, zero, 0;",
        "setp.eq.b32 add, zero, 0;",
        "wgmma.fence.sync.aligned;",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d}, {a}, {b}, fresh, 1, 1, 0, 0;",
        "add.s64 da, {a}, 2;",
        "add.s64 db, {b}, 2;",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d}, da, db, add, 1, 1, 0, 0;",
        "add.s64 da, {a}, 4;",
        "add.s64 db, {b}, 4;",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d}, da, db, add, 1, 1, 0, 0;",
        "add.s64 da, {a}, 6;",
        "add.s64 db, {b}, 6;",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d}, da, db, add, 1, 1, 0, 0;",
        "wgmma.commit_group.sync.aligned;",
        "}}",
        d = out(_) d,
        a = in(_) a,
        b = in(_) b,
    );
    d
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::device::DeviceCaps;
    use crate::kernel::tensors::{BF16, F32, KernelTensor};
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

    /// The first CUDA device with tensor maps (SM90 and newer), or why the test skips.
    fn hopper() -> Result<Client, String> {
        let device = cubecl::Device::enumerate_all()
            .into_iter()
            .find(|d| matches!(d, cubecl::Device::Cuda(_)))
            .ok_or("no CUDA device")?;
        let client = device.client();
        match DeviceCaps::of(&client, BF16).tma {
            true => Ok(client),
            false => Err("a CUDA device before SM90".to_string()),
        }
    }

    #[test]
    fn warpgroup_product_matches_the_reference() {
        let client = match hopper() {
            Ok(client) => client,
            Err(reason) => {
                assert!(
                    std::env::var_os("BURN_FLASH_REQUIRE_CUDA").is_none(),
                    "BURN_FLASH_REQUIRE_CUDA is set: {reason}"
                );
                eprintln!("warpgroup_product_matches_the_reference: skipping: {reason}");
                return;
            }
        };
        let mut rng = Rng::new(50);
        let round =
            |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
        let (a, b) = (round(rng.normals(64 * 64)), round(rng.normals(64 * 64)));
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
        let got = out.read::<f32>();
        assert_eq!(out.dtype, F32);
        let mut worst = 0f64;
        for (i, row) in got.chunks(64).enumerate() {
            for (j, &value) in row.iter().enumerate() {
                let expected: f64 = (0..64)
                    .map(|k| a[i * 64 + k].to_f64() * b[j * 64 + k].to_f64())
                    .sum();
                // f32 accumulation of 64 exact products: within 64 f32 roundings of the sum
                // of their magnitudes; a wrong row, column or swizzle is off by O(1).
                let bound: f64 = (0..64)
                    .map(|k| (a[i * 64 + k].to_f64() * b[j * 64 + k].to_f64()).abs())
                    .sum::<f64>()
                    * 64.0
                    * f32::EPSILON as f64;
                let error = (value as f64 - expected).abs();
                assert!(
                    error.is_finite() && error <= bound,
                    "S[{i}][{j}] = {value}, expected {expected} (bound {bound})"
                );
                worst = worst.max(error);
            }
        }
        eprintln!("warpgroup product 64x64x64 bf16: largest error {worst:.3e}");
    }
}
