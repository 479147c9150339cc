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

use cubecl::ir::ElemType;
use cubecl::prelude::*;
use cubecl::zspace::Shape;

use super::tensors::{KernelTensor, U32, address_type, vector_width};

/// One unit per packed word; consecutive units take consecutive words of a query row, so a
/// plane reads a row's mask contiguously, `N` elements per load.
#[cube(launch_unchecked, address_type = "dynamic")]
fn pack_mask_kernel<M: Int, N: Size>(
    mask: &Tensor<Vector<M, N>>,
    packed: &mut Tensor<u32>,
    #[comptime] words: usize,
    #[define(M)] _dtype: ElemType,
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
                        let hidden = u32::cast_from(values.extract(e) & M::new(1));
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
                all &= words.extract(e);
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

    let mut firsts = Shared::<[u32]>::new_slice(units);
    let mut ends = Shared::<[u32]>::new_slice(units);
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
pub(crate) struct PackedMask {
    pub words: KernelTensor,
    pub hidden_blocks: KernelTensor,
}

/// `mask` (`[b|1, h|1, seq_q, seq_k]` contiguous integers, bit 0 set where hidden) packed for a
/// forward of `block_q`-row query blocks over `block_kv`-key blocks (a multiple of 32).
pub(crate) fn pack_mask(mask: &KernelTensor, block_q: usize, block_kv: usize) -> PackedMask {
    let words = pack_words(mask, block_q, block_kv);
    let hidden_blocks = hidden_blocks(&words, block_q, block_kv);
    PackedMask {
        words,
        hidden_blocks,
    }
}

fn pack_words(mask: &KernelTensor, block_q: usize, block_kv: usize) -> KernelTensor {
    let dims = mask.meta.shape().clone();
    let (seq_q, seq_k) = (dims[2], dims[3]);
    let words = block_kv / 32;
    let shape = Shape::new([
        dims[0],
        dims[1],
        seq_k.div_ceil(block_kv),
        seq_q.div_ceil(block_q) * block_q * words,
    ]);
    let packed = KernelTensor::empty(&mask.client, shape, U32);
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
            mask.dtype,
        );
    }
    packed
}

fn hidden_blocks(packed: &KernelTensor, block_q: usize, block_kv: usize) -> KernelTensor {
    const UNITS: usize = 128;
    let dims = packed.meta.shape().clone();
    let block_words = block_q * block_kv / 32;
    let q_blocks = dims[3] / block_words;
    let shape = Shape::new([dims[0], dims[1], q_blocks, dims[2] + 2]);
    let hidden = KernelTensor::empty(&packed.client, shape, U32);
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
