//! Stage level: key/value blocks staged in shared memory, either by asynchronous 16-byte copies
//! (tensor-core path, overlapped with the previous block's math) or by plain loads (portable).

use cubecl::prelude::barrier::{Barrier, copy_async, copy_async_checked};
use cubecl::prelude::*;

use super::config::{CHUNK, Pitch, TileConfig};

/// Offset of element (`row`, `col`) inside one staged block of `width` columns. With swizzle,
/// 16-byte chunk `c` of row `r` lives at chunk `c ^ (r % 8)`: eight consecutive rows read at the
/// same column land in eight distinct bank groups.
#[cube]
pub fn stage_offset(
    row: usize,
    col: usize,
    #[comptime] width: usize,
    #[comptime] swizzle: bool,
) -> usize {
    if comptime!(swizzle) {
        let chunk = (col / CHUNK) ^ (row % 8);
        row * width + chunk * CHUNK + col % CHUNK
    } else {
        row * width + col
    }
}

/// A shared-memory index that compile-time offsets will be added to, masked to the range of
/// shared-memory indices (below 2^17: 228 KiB of 16-bit elements at most), which changes no valid
/// index. Indices are 32-bit unsigned, so without a bound the compiler must assume that adding
/// the constant may wrap and cannot fold it into the instruction's immediate offset: it then
/// spends an add and a shift per shared-memory access.
#[cube]
pub fn smem_anchor(index: usize) -> usize {
    index & comptime!((1usize << 17) - 1)
}

/// `base` plus the offset under `pitch` of row `row0 + lane_row`, 16-byte chunk
/// `chunk0 + lane_chunk` of a swizzled block, split into a part that depends on the lane and
/// `base` only and a compile-time constant, so that every fragment read of an unrolled product
/// costs one register plus an immediate offset instead of its own swizzle arithmetic. The
/// per-lane part depends only on `chunk0 % 8`, so at most eight distinct values exist and the
/// compiler computes each once per `base`.
///
/// The per-lane part is a [`smem_anchor`], so the constant becomes the immediate offset.
///
/// Requires `row0 % 8 == 0` (the row's swizzle key is then `lane_row % 8`), and `lane_chunk`
/// below 8 with no bit in common with `chunk0 % 8` (their sum is then an XOR within one group of
/// eight chunks); the callers' lane patterns satisfy both by construction, except the copies'
/// into whole rows ([`Pitch::rows`]), whose lane chunks may reach later groups: those groups
/// follow each other there.
#[cube]
pub fn swizzled_offset(
    base: usize,
    lane_row: usize,
    lane_chunk: usize,
    #[comptime] row0: usize,
    #[comptime] chunk0: usize,
    #[comptime] pitch: Pitch,
) -> usize {
    let key = (lane_chunk ^ (lane_row % 8)) ^ comptime!(chunk0 % 8);
    smem_anchor(base + lane_row * pitch.row + key * CHUNK)
        + comptime!(row0 * pitch.row + chunk0 / 8 * pitch.group)
}

/// Issue asynchronous copies of rows `[first_row, first_row + rows)` of one head of `src`
/// (`width` wide, rows `row_stride` apart) into `stage` (rows `cfg.stride(width)` apart). Rows at
/// or past `seq` are zero-filled, never read.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_block_async<E: Float>(
    src: &Tensor<E>,
    head_base: usize,
    row_stride: usize,
    first_row: usize,
    seq: usize,
    stage: &mut Shared<[E]>,
    stage_base: usize,
    #[comptime] rows: usize,
    #[comptime] width: usize,
    #[comptime] cfg: TileConfig,
) {
    let chunks_per_row = comptime!(width / CHUNK);
    let units = comptime!(cfg.units());
    let stride = comptime!(cfg.stride(width));
    if comptime!(
        units.is_multiple_of(chunks_per_row) && rows.is_multiple_of(units / chunks_per_row)
    ) {
        // Each pass of the units covers `pass_rows` whole rows: a unit's chunk is the same in
        // every pass and its rows step by a constant.
        let pass_rows = comptime!(units / chunks_per_row);
        let lane_row = UNIT_POS as usize / chunks_per_row;
        let lane_chunk = UNIT_POS as usize % chunks_per_row;
        #[unroll]
        for pass in 0..comptime!(rows / pass_rows) {
            let row = comptime!(pass * pass_rows) + lane_row;
            let dst = if comptime!(pass_rows % 8 == 0) {
                swizzled_offset(
                    stage_base,
                    lane_row,
                    lane_chunk,
                    comptime!(pass * pass_rows),
                    0usize,
                    comptime!(Pitch::rows(stride)),
                )
            } else {
                stage_base + stage_offset(row, lane_chunk * CHUNK, stride, true)
            };
            copy_chunk::<E>(
                src,
                head_base + lane_chunk * CHUNK,
                row_stride,
                first_row + row,
                seq,
                stage,
                dst,
            );
        }
    } else {
        // Rows of a width the units do not divide (head dim 96): the units walk the block's
        // chunks in order, a pass at a time.
        let chunks = comptime!(rows * chunks_per_row);
        #[unroll]
        for pass in 0..comptime!(chunks.div_ceil(units)) {
            let id = comptime!(pass * units) + UNIT_POS as usize;
            if id < chunks {
                let row = id / chunks_per_row;
                let chunk = id % chunks_per_row;
                copy_chunk::<E>(
                    src,
                    head_base + chunk * CHUNK,
                    row_stride,
                    first_row + row,
                    seq,
                    stage,
                    stage_base + stage_offset(row, chunk * CHUNK, stride, true),
                );
            }
        }
    }
}

/// One asynchronous 16-byte copy from `src[column_base + global_row · row_stride..]` to
/// `stage[dst..]`. A row at or past `seq` points at the head's first element with a zero-length
/// source, which `cp.async` zero-fills.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_chunk<E: Float>(
    src: &Tensor<E>,
    column_base: usize,
    row_stride: usize,
    global_row: usize,
    seq: usize,
    stage: &mut Shared<[E]>,
    dst: usize,
) {
    let in_bounds = global_row < seq;
    let src_start = column_base + select(in_bounds, global_row * row_stride, 0usize);
    copy_or_zero_fill(src, src_start, in_bounds, stage, dst, CHUNK);
}

/// One asynchronous copy of `len` elements from `src[src_start..]` to `stage[dst..]`, or, when
/// not `in_bounds`, a zero-length source that `cp.async` zero-fills (`src_start` must then still
/// lie inside `src`).
///
/// Kernels built with 64-bit indices (tensors of more than `u32::MAX` elements) store the zeros
/// themselves: CubeCL 0.12.0-pre.1's C++ backend passes `copy_async_checked`'s source size as a
/// 64-bit register there, and `ptxas` refuses it (`cp.async` takes 32 bits), so the launch would
/// fail. The stores are ordered before the readers by the unit's arrival on the stage barrier,
/// as the copies are.
#[cube]
pub fn copy_or_zero_fill<N: Numeric>(
    src: &Tensor<N>,
    src_start: usize,
    in_bounds: bool,
    stage: &mut Shared<[N]>,
    dst: usize,
    #[comptime] len: usize,
) {
    let index_bytes = usize::size();
    if comptime!(index_bytes > 4) {
        if in_bounds {
            copy_whole(src, src_start, stage, dst, len);
        } else {
            #[unroll]
            for i in 0..len {
                stage[dst + i] = N::from_int(0);
            }
        }
    } else {
        let src_len = select(in_bounds, len, 0usize);
        copy_async_checked(
            src.slice(src_start, src_start + src_len),
            stage.slice_mut(dst, dst + len),
            len as u32,
        );
    }
}

/// One asynchronous copy of `len` elements from `src[src_start..]`, all in bounds, to
/// `stage[dst..]`; unchecked where indices are 64-bit ([`copy_or_zero_fill`] says why).
#[cube]
pub fn copy_whole<N: Numeric>(
    src: &Tensor<N>,
    src_start: usize,
    stage: &mut Shared<[N]>,
    dst: usize,
    #[comptime] len: usize,
) {
    let index_bytes = usize::size();
    let (src, dst) = (
        src.slice(src_start, src_start + len),
        stage.slice_mut(dst, dst + len),
    );
    if comptime!(index_bytes > 4) {
        copy_async(src, dst, len as u32);
    } else {
        copy_async_checked(src, dst, len as u32);
    }
}

/// Stage `stage` (0 or 1) of a double-buffered pair of operands: copies of rows
/// `[first_row, first_row + cfg.block_kv)` of `first` (`cfg.head_dim` wide, rows
/// `first_row_stride` apart) and `second` (`cfg.value_dim` wide, `second_row_stride`) issued
/// asynchronously, to be committed to that stage's barrier ([`StageBarriers::commit`]).
/// `first_stages` holds two blocks of `cfg.head_stride()`-apart rows, `second_stages` two of
/// `cfg.value_stride()`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_stage<E: Float>(
    first: &Tensor<E>,
    first_base: usize,
    first_row_stride: usize,
    second: &Tensor<E>,
    second_base: usize,
    second_row_stride: usize,
    first_row: usize,
    seq: usize,
    first_stages: &mut Shared<[E]>,
    second_stages: &mut Shared<[E]>,
    stage: usize,
    #[comptime] cfg: TileConfig,
) {
    copy_block_async::<E>(
        first,
        first_base,
        first_row_stride,
        first_row,
        seq,
        first_stages,
        stage * comptime!(cfg.block_kv * cfg.head_stride()),
        cfg.block_kv,
        cfg.head_dim,
        cfg,
    );
    copy_block_async::<E>(
        second,
        second_base,
        second_row_stride,
        first_row,
        seq,
        second_stages,
        stage * comptime!(cfg.block_kv * cfg.value_stride()),
        cfg.block_kv,
        cfg.value_dim,
        cfg,
    );
}

/// [`fetch_stage`] by tensor maps ([`TileConfig::tma`]): rows `[first_row, first_row +
/// cfg.block_kv)` of head `head` of batch `batch` of `first` and `second` (maps of `[b, h, seq,
/// cfg.head_dim]` tensors with `cfg.block_kv × 64` boxes and the 128-byte swizzle) into stage
/// `stage`, one box per 64 columns ([`TileConfig::staged_pitch`]'s panels where rows are wider),
/// completing on that stage's barrier. Unit 0 issues every box and adds their bytes to the
/// barrier's expected transactions before its own arrival, so the stage cannot complete without
/// them; rows past the sequence arrive as zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_stage_tma<E: Float>(
    first: &TensorMap<E, Tiled>,
    second: &TensorMap<E, Tiled>,
    batch: usize,
    head: usize,
    first_row: usize,
    first_stages: &mut Shared<[E]>,
    second_stages: &mut Shared<[E]>,
    stage: usize,
    barriers: &StageBarriers,
    #[comptime] cfg: TileConfig,
) {
    if UNIT_POS == 0 {
        let first_len = comptime!(cfg.block_kv * cfg.head_stride());
        let second_len = comptime!(cfg.block_kv * cfg.value_stride());
        let size = E::size();
        let bytes = comptime!((first_len + second_len) * size) as u32;
        let at = (batch as i32, head as i32, first_row as i32);
        let bases = (stage * first_len, stage * second_len);
        if stage == 0 {
            load_maps(
                &barriers.first,
                first,
                second,
                first_stages,
                second_stages,
                bases,
                at,
                bytes,
                cfg,
            );
        } else if stage == 1 {
            load_maps(
                &barriers.second,
                first,
                second,
                first_stages,
                second_stages,
                bases,
                at,
                bytes,
                cfg,
            );
        } else {
            #[comptime]
            if let ComptimeOption::Some(third) = &barriers.third {
                load_maps(
                    third,
                    first,
                    second,
                    first_stages,
                    second_stages,
                    bases,
                    at,
                    bytes,
                    cfg,
                );
            }
        }
    }
}

/// Expect `bytes` on `barrier`, then copy the boxes of `first` and `second` at (batch, head,
/// row) `at`, one per 64 columns, into the panels of the stages from `bases`, completing on it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_maps<E: Float>(
    barrier: &Barrier,
    first: &TensorMap<E, Tiled>,
    second: &TensorMap<E, Tiled>,
    first_stages: &mut Shared<[E]>,
    second_stages: &mut Shared<[E]>,
    bases: (usize, usize),
    at: (i32, i32, i32),
    bytes: u32,
    #[comptime] cfg: TileConfig,
) {
    let (batch, head, row) = at;
    let (first_base, second_base) = bases;
    let cols = comptime!(8 * CHUNK);
    let panel = comptime!(cfg.block_kv * cols);
    barrier.expect_tx(bytes);
    #[unroll]
    for p in 0..comptime!(cfg.head_dim / cols) {
        let col = comptime!(p * cols) as i32;
        let start = comptime!(p * panel);
        let first_dst = first_stages.slice_mut(first_base + start, first_base + start + panel);
        barrier.tma_load_4d(first, first_dst, batch, head, row, col);
        let second_dst = second_stages.slice_mut(second_base + start, second_base + start + panel);
        barrier.tma_load_4d(second, second_dst, batch, head, row, col);
    }
}

/// Offset of element (`row`, `col`) in a staged block of a score input (`cfg.block_kv` elements
/// per row, `chunk` per 16 bytes). The 16-byte chunks are XOR-swizzled so that the eight rows of
/// one accumulator read start in distinct bank groups: by `row % 8` where a row spans a
/// 128-byte line or more (the bias: [`stage_offset`]'s swizzle, which `ldmatrix` reads), by the
/// row's line where several rows share one (a u8 mask: two 64-byte rows per line).
#[cube]
pub fn input_offset(
    row: usize,
    col: usize,
    #[comptime] chunk: usize,
    #[comptime] cfg: TileConfig,
) -> usize {
    let (rows_per_line, keys) = comptime!(input_swizzle(chunk, &cfg));
    let key = (row / rows_per_line) % keys;
    row * cfg.block_kv + ((col / chunk) ^ key) * chunk + col % chunk
}

/// [`input_offset`]'s swizzle: rows per 128-byte line and distinct keys. Rows
/// `rows_per_line · keys` apart share their key.
pub fn input_swizzle(chunk: usize, cfg: &TileConfig) -> (usize, usize) {
    let chunks = cfg.block_kv / chunk;
    ((8 / chunks).max(1), chunks.min(8))
}

/// One barrier per stage of a ring of two or three stages; a stage's copies complete on its
/// barrier.
#[derive(CubeType)]
pub struct StageBarriers {
    first: Shared<Barrier>,
    second: Shared<Barrier>,
    third: ComptimeOption<Shared<Barrier>>,
}

#[cube]
impl StageBarriers {
    /// Barriers for the whole cube and `stages` stages (2 or 3); the caller synchronises the
    /// cube before first use.
    pub fn new(#[comptime] stages: usize) -> StageBarriers {
        let third = if comptime!(stages > 2) {
            ComptimeOption::new_Some(Barrier::shared(CUBE_DIM, UNIT_POS == 0))
        } else {
            ComptimeOption::new_None()
        };
        StageBarriers {
            first: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            second: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            third,
        }
    }

    /// Make the copies issued so far complete on stage `stage`'s barrier.
    pub fn commit(&self, stage: usize) {
        if stage == 0 {
            self.first.commit_copy_async();
        } else if stage == 1 {
            self.second.commit_copy_async();
        } else {
            #[comptime]
            if let ComptimeOption::Some(third) = &self.third {
                third.commit_copy_async();
            }
        }
    }

    /// Wait until stage `stage` has landed. Every unit arriving also proves that all are done
    /// with the stage computed before it, so that one may be refilled.
    pub fn wait(&self, stage: usize) {
        if stage == 0 {
            self.first.arrive_and_wait();
        } else if stage == 1 {
            self.second.arrive_and_wait();
        } else {
            #[comptime]
            if let ComptimeOption::Some(third) = &self.third {
                third.arrive_and_wait();
            }
        }
    }
}

/// Load rows `[first_row, first_row + rows)` of one head of `src` into `stage` with plain loads
/// shared by `units` units; rows at or past `seq` are stored as zeros. The caller synchronises
/// the cube.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_block<E: Float>(
    src: &Tensor<E>,
    head_base: usize,
    first_row: usize,
    seq: usize,
    stage: &mut Shared<[E]>,
    #[comptime] rows: usize,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] swizzle: bool,
) {
    let elems = comptime!(rows * width);
    let row_stride = src.stride(2);

    for i in 0..comptime!(elems.div_ceil(units)) {
        let id = i * units + UNIT_POS as usize;
        if id < elems {
            let row = id / width;
            let col = id % width;
            let global_row = first_row + row;
            let mut value = E::new(0.0);
            if global_row < seq {
                value = src[head_base + global_row * row_stride + col];
            }
            stage[stage_offset(row, col, width, swizzle)] = value;
        }
    }
}

/// Zero rows `[from, rows)` of a staged block of `rows` rows laid out by `pitch`, `width`
/// elements a row (its stride), shared by `units` units. A tensor map loads whole boxes: the
/// rows past a sequence's length hold whatever lies there, and a product with a probability of
/// 0 would still turn a non-finite one into NaN. Whole rows are zeroed, so the swizzle, which
/// permutes chunks within a row, does not matter. The caller synchronises the cube and fences
/// the writes from the copy engine's next use of the stage.
#[cube]
pub fn zero_rows_from<E: Float>(
    stages: &mut Shared<[E]>,
    base: usize,
    from: usize,
    #[comptime] rows: usize,
    #[comptime] width: usize,
    #[comptime] pitch: Pitch,
    #[comptime] units: usize,
) {
    let group = comptime!(8 * CHUNK);
    let elems = (rows - from) * width;
    let mut at = UNIT_POS as usize;
    while at < elems {
        let (row, col) = (from + at / width, at % width);
        stages[base + (col / group) * pitch.group + row * pitch.row + col % group] = E::new(0.0);
        at += units;
    }
}
