//! A per-pair boolean mask packed into bits for the tensor-core forward. Read as integers, the
//! mask costs the forward a shared-memory load per score; packed, one 32-bit word serves 32
//! keys of a row, and a staged block shrinks eightfold. The blocks the mask hides wholly are
//! listed too, so that the forward neither loads nor computes them (document masks).
//!
//! Words, `[b|1, h|1, blocks, rows · words]` u32: `words = block_kv / 32` words per query row
//! of each KV block, bit `j % 32` of word `j / 32` set where the mask hides key `j` of the block
//! (keys past `seq_k` set too). The words of one KV block are contiguous over the query rows, so
//! a query block's are a contiguous run that 16-byte copies stage; `rows` is `seq_q` rounded up
//! to whole query blocks (the extra rows hide every key: no query is there).
//!
//! Hidden blocks, `[b|1, h|1, seq_q / block_q, blocks + 2]` u32 (rounded up): 1 where the mask
//! hides every pair of that query block and KV block; then the query block's visible range, the
//! first KV block it sees and one past the last (`blocks, 0` when it sees none), so that the
//! forward walks only that range.

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::prelude::*;

use super::tensors::{address_type, vector_width};

/// One unit per packed word; consecutive units take consecutive words of a query row, so a
/// plane reads a row's mask contiguously, `N` elements per load.
#[cube(launch_unchecked, address_type = "dynamic")]
fn pack_mask_kernel<M: Int, N: Size>(
    mask: &Tensor<Vector<M, N>>,
    packed: &mut Tensor<u32>,
    #[comptime] words: usize,
    #[define(M)] _dtype: StorageType,
) {
    let width = mask.vector_size();
    if ABSOLUTE_POS < packed.len() {
        let row_words = packed.shape(2) * words;
        let rows = packed.shape(3) / words;
        let word = ABSOLUTE_POS % row_words;
        let row = ABSOLUTE_POS / row_words % rows;
        let plane = ABSOLUTE_POS / (row_words * rows);
        let (batch, head) = (plane / packed.shape(1), plane % packed.shape(1));
        let (seq_q, seq_k) = (mask.shape(2), mask.shape(3));

        let mut bits = 0xFFFF_FFFFu32;
        if row < seq_q {
            bits = 0u32;
            let base = batch * mask.stride(0) + head * mask.stride(1) + row * mask.stride(2);
            #[unroll]
            for part in 0..comptime!(32 / width) {
                let key = word * 32 + part * width;
                // `seq_k` is a multiple of the vector width: a vector is wholly in or out.
                if key < seq_k {
                    let values = mask[(base + key) / width];
                    #[unroll]
                    for e in 0..width {
                        let hidden = u32::cast_from(values[e] & M::new(1));
                        bits |= hidden << comptime!((part * width + e) as u32);
                    }
                } else {
                    bits |=
                        comptime!(((1u64 << width) - 1) as u32) << comptime!((part * width) as u32);
                }
            }
        }
        let at = batch * packed.stride(0)
            + head * packed.stride(1)
            + word / words * packed.stride(2)
            + row * words
            + word % words;
        packed[at] = bits;
    }
}

/// One cube per (query block, head, batch) of the packed mask, a unit per KV block (striding
/// over them): the block's flag, 1 where its `block_words` words (contiguous, `N` per load) all
/// have every bit set; then the query block's visible range, by a min/max over the cube.
#[cube(launch_unchecked, address_type = "dynamic")]
fn hidden_blocks_kernel<N: Size>(
    packed: &Tensor<Vector<u32, N>>,
    hidden: &mut Tensor<u32>,
    #[comptime] block_words: usize,
    #[comptime] units: usize,
) {
    let width = packed.vector_size();
    let (q_block, head, batch) = (
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
    );
    let unit = UNIT_POS as usize;
    let kv_blocks = hidden.shape(3) - 2;
    let row = batch * hidden.stride(0) + head * hidden.stride(1) + q_block * hidden.stride(2);
    let row_words = batch * packed.stride(0) + head * packed.stride(1) + q_block * block_words;

    let mut first = u32::cast_from(kv_blocks);
    let mut end = 0u32;
    let mut kv_block = unit;
    while kv_block < kv_blocks {
        let start = (row_words + kv_block * packed.stride(2)) / width;
        let mut all = 0xFFFF_FFFFu32;
        for at in 0..comptime!(block_words / width) {
            let words = packed[start + at];
            #[unroll]
            for e in 0..width {
                all &= words[e];
            }
            // One visible pair settles it (most blocks of most masks).
            if all != 0xFFFF_FFFFu32 {
                break;
            }
        }
        let visible = all != 0xFFFF_FFFFu32;
        hidden[row + kv_block] = u32::cast_from(!visible);
        if visible {
            first = min(first, u32::cast_from(kv_block));
            end = u32::cast_from(kv_block + 1);
        }
        kv_block += units;
    }

    let mut firsts = SharedMemory::<u32>::new(units);
    let mut ends = SharedMemory::<u32>::new(units);
    firsts[unit] = first;
    ends[unit] = end;
    sync_cube();
    #[unroll]
    for step in 1..comptime!(units.trailing_zeros() as usize + 1) {
        let half = comptime!(units >> step);
        if unit < half {
            firsts[unit] = min(firsts[unit], firsts[unit + half]);
            ends[unit] = max(ends[unit], ends[unit + half]);
        }
        sync_cube();
    }
    if unit == 0 {
        hidden[row + kv_blocks] = firsts[0];
        hidden[row + kv_blocks + 1] = ends[0];
    }
}

/// A mask packed for the forward: its words and its wholly hidden blocks (module docs).
pub(crate) struct PackedMask<R: CubeRuntime> {
    pub words: CubeTensor<R>,
    pub hidden_blocks: CubeTensor<R>,
}

/// `mask` (`[b|1, h|1, seq_q, seq_k]` contiguous integers, bit 0 set where hidden) packed for a
/// forward of `block_q`-row query blocks over `block_kv`-key blocks (a multiple of 32).
pub(crate) fn pack_mask<R: CubeRuntime>(
    mask: &CubeTensor<R>,
    block_q: usize,
    block_kv: usize,
) -> PackedMask<R> {
    let words = pack_words(mask, block_q, block_kv);
    let hidden_blocks = hidden_blocks(&words, block_q, block_kv);
    PackedMask {
        words,
        hidden_blocks,
    }
}

fn pack_words<R: CubeRuntime>(
    mask: &CubeTensor<R>,
    block_q: usize,
    block_kv: usize,
) -> CubeTensor<R> {
    let dims = mask.meta.shape().clone();
    let (seq_q, seq_k) = (dims[2], dims[3]);
    let words = block_kv / 32;
    let shape = Shape::new([
        dims[0],
        dims[1],
        seq_k.div_ceil(block_kv),
        seq_q.div_ceil(block_q) * block_q * words,
    ]);
    let packed =
        empty_device_contiguous_dtype(mask.client.clone(), mask.device.clone(), shape, DType::U32);
    let units = packed.meta.num_elements();
    if units == 0 {
        return packed;
    }
    let width = vector_width(&[mask]).min(32);
    let cube_dim = CubeDim::new_1d(256);
    let address = address_type(&[mask, &packed]);
    // SAFETY: one unit per packed word, guarded by its length; the mask is read only at rows
    // below `seq_q` and keys below `seq_k`, a whole vector at a time (the width divides `seq_k`).
    unsafe {
        pack_mask_kernel::launch_unchecked(
            &mask.client,
            cubecl::calculate_cube_count_elemwise(&mask.client, units, cube_dim),
            cube_dim,
            address,
            width,
            mask.clone().into_tensor_arg(),
            packed.clone().into_tensor_arg(),
            words,
            mask.dtype.into(),
        );
    }
    packed
}

fn hidden_blocks<R: CubeRuntime>(
    packed: &CubeTensor<R>,
    block_q: usize,
    block_kv: usize,
) -> CubeTensor<R> {
    const UNITS: usize = 128;
    let dims = packed.meta.shape().clone();
    let block_words = block_q * block_kv / 32;
    let q_blocks = dims[3] / block_words;
    let shape = Shape::new([dims[0], dims[1], q_blocks, dims[2] + 2]);
    let hidden = empty_device_contiguous_dtype(
        packed.client.clone(),
        packed.device.clone(),
        shape,
        DType::U32,
    );
    if hidden.meta.num_elements() == 0 {
        return hidden;
    }
    // A block's words are a multiple of 4 (block_q is): the width divides them.
    let width = vector_width(&[packed]).min(4);
    let address = address_type(&[packed, &hidden]);
    // SAFETY: one cube per row of flags; its units write the flags of the KV blocks below the
    // row's length and read those blocks' words, which lie inside the packed tensor (whole query
    // blocks of rows); unit 0 writes the row's two last elements.
    unsafe {
        hidden_blocks_kernel::launch_unchecked(
            &packed.client,
            CubeCount::Static(q_blocks as u32, dims[1] as u32, dims[0] as u32),
            CubeDim::new_1d(UNITS as u32),
            address,
            width,
            packed.clone().into_tensor_arg(),
            hidden.clone().into_tensor_arg(),
            block_words,
            UNITS,
        );
    }
    hidden
}

#[cfg(test)]
mod tests {
    //! The packing kernel on the bare wgpu backend (lavapipe in CI), against the bits computed
    //! here from the mask's values.
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use burn::tensor::{Bool, Distribution, Int, Tensor, TensorData};
    use burn_cubecl::CubeBackend;
    use burn_cubecl::tensor::CubeTensor;

    use crate::kernel::tensors::ScoreInputs;

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    #[test]
    fn packs_a_bit_per_pair_by_kv_block() {
        let device = WgpuDevice::default();
        // (mask dims, block_q, block_kv, documents): keys past a block's end, odd key counts
        // (one element per load) and multiples of 4 (vectors), rows past the last query block,
        // broadcasts; with documents (query i sees keys of run i / 10 only, 30 % of those
        // hidden at random), blocks the mask hides wholly.
        for &(dims, block_q, block_kv, documents) in &[
            ([2usize, 1, 70, 100], 32usize, 64usize, false),
            ([1, 3, 5, 33], 16, 32, false),
            ([1, 1, 128, 64], 128, 64, false),
            ([2, 2, 9, 256], 128, 128, false),
            ([1, 2, 100, 300], 16, 32, true),
            ([2, 1, 70, 333], 32, 64, true),
        ] {
            let [_, _, sq, sk] = dims;
            let uniform = Tensor::<B, 4>::random(dims, Distribution::Uniform(0.0, 1.0), &device);
            let values: Vec<bool> = uniform
                .to_data()
                .iter::<f32>()
                .enumerate()
                .map(|(n, u)| u < 0.3 || (documents && (n / sk % sq) / 10 != (n % sk) / 37))
                .collect();
            let mask =
                Tensor::<B, 4, Bool>::from_data(TensorData::new(values.clone(), dims), &device);
            let inputs = ScoreInputs::new(Some(mask.into_primitive()), None);
            let packed = super::pack_mask(inputs.mask.as_ref().unwrap(), block_q, block_kv);
            let read = |t: CubeTensor<WgpuRuntime>| {
                let dims = t.meta.shape().clone();
                let values = Tensor::<B, 4, Int>::from_primitive(t)
                    .to_data()
                    .convert::<u32>()
                    .to_vec::<u32>()
                    .unwrap();
                (dims, values)
            };
            let (packed_dims, got) = read(packed.words);
            let (hidden_dims, hidden) = read(packed.hidden_blocks);

            let [b, h, _, _] = dims;
            let (words, blocks) = (block_kv / 32, sk.div_ceil(block_kv));
            let rows = sq.div_ceil(block_q) * block_q;
            assert_eq!(packed_dims[..], [b, h, blocks, rows * words]);
            let mut expected = Vec::with_capacity(got.len());
            for plane in 0..b * h {
                for block in 0..blocks {
                    for row in 0..rows {
                        for word in 0..words {
                            let mut bits = 0u32;
                            for bit in 0..32 {
                                let key = block * block_kv + word * 32 + bit;
                                let hidden =
                                    row >= sq || key >= sk || values[(plane * sq + row) * sk + key];
                                bits |= u32::from(hidden) << bit;
                            }
                            expected.push(bits);
                        }
                    }
                }
            }
            assert_eq!(got, expected, "mask {dims:?}, blocks {block_q}×{block_kv}");

            // A block is hidden when no query row of it below `sq` sees a key below `sk`; each
            // row of flags ends with the first visible block and one past the last.
            let q_blocks = rows / block_q;
            assert_eq!(hidden_dims[..], [b, h, q_blocks, blocks + 2]);
            let mut expected_hidden = Vec::new();
            for plane in 0..b * h {
                for q_block in 0..q_blocks {
                    let flags: Vec<u32> = (0..blocks)
                        .map(|block| {
                            let sees = |row: usize| {
                                (0..block_kv)
                                    .map(|col| block * block_kv + col)
                                    .any(|key| key < sk && !values[(plane * sq + row) * sk + key])
                            };
                            let all = !(q_block * block_q..(q_block + 1) * block_q)
                                .any(|row| row < sq && sees(row));
                            u32::from(all)
                        })
                        .collect();
                    let visible = || (0..blocks).filter(|&block| flags[block] == 0);
                    let first = visible().next().unwrap_or(blocks);
                    let end = visible().next_back().map_or(0, |block| block + 1);
                    expected_hidden.extend(flags.iter().copied());
                    expected_hidden.extend([first as u32, end as u32]);
                }
            }
            assert_eq!(hidden, expected_hidden, "mask {dims:?}, hidden blocks");
        }
    }
}
