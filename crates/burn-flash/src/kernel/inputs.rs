//! The per-score inputs beside Q, K and V: a boolean mask (`true` hides the pair) and an additive
//! bias, each `[batch|1, heads|1, seq_q|1, seq_k]` and contiguous, a dim of 1 broadcasting. Both
//! are `ComptimeOption`s: a kernel without them has no trace of them. The backward and the
//! portable forward read them element by element where the score registers sit; the tensor-core
//! forward stages each KV block's block of them in shared memory beside the keys and values
//! ([`Staged`](super::config::Staged)), where the launch can, a per-pair mask packed into bits
//! ([`pack`](super::pack)).
//!
//! The bias is added to the raw (unscaled, softcapped) scores divided by the scale, so that
//! everything downstream, which multiplies by the scale, sees `scale · s + bias` as Burn's
//! attention defines it. ALiBi's bias, `−slope · |key − diagonal|`, is computed instead of read.

use cubecl::prelude::*;

use super::band::{Band, diagonal};
use super::config::{SMEM_ALIGN, TileConfig};
use super::stage::{copy_or_zero_fill, copy_whole, input_offset, input_swizzle, smem_anchor};
use super::tile::AttentionTile;

/// Where one (batch, head) starts in a broadcast input and how far apart its query rows are.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Broadcast {
    pub base: usize,
    pub row_stride: usize,
}

/// The view of (batch, head) in `t` (`[b|1, h|1, seq_q|1, seq_k]` contiguous).
#[cube]
pub fn broadcast<N: CubePrimitive>(t: &Tensor<N>, batch: usize, head: usize) -> Broadcast {
    Broadcast {
        base: select(t.shape(0) == 1, 0usize, batch * t.stride(0))
            + select(t.shape(1) == 1, 0usize, head * t.stride(1)),
        row_stride: select(t.shape(2) == 1, 0usize, t.stride(2)),
    }
}

/// The index of (query, key) in a broadcast input, clamped into the sequences: pairs outside
/// them read a neighbour's value, which is never used (they are hidden). Both sequences are
/// non-empty wherever a block is visited.
#[cube]
fn element(at: Broadcast, band: Band, query: usize, key: usize) -> usize {
    at.base + min(query, band.seq_q - 1) * at.row_stride + min(key, band.seq_k - 1)
}

/// Whether the mask input, if any, lets `query` see `key` (both within the sequences).
#[cube]
pub fn mask_allows<M: Int>(
    mask: ComptimeOption<&Tensor<M>>,
    at: Broadcast,
    band: Band,
    query: usize,
    key: usize,
) -> bool {
    let mut allows = true;
    #[comptime]
    if let ComptimeOption::Some(mask) = mask {
        // Burn stores booleans as integers of which only bit 0 counts.
        allows = (mask[element(at, band, query, key)] & M::new(1)) == M::new(0);
    }
    allows
}

/// Whether the mask input lets the pair of each score register through (the block of queries
/// from `q_start` and keys from `kv_start`; `transposed` as in [`pair_of`]), read from the
/// tensor. A mask the same for every query (`cfg.mask.per_key`) is read once per key the unit
/// holds.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn mask_input_allows<E: Float, M: Int, T: AttentionTile<E>>(
    mask: ComptimeOption<&Tensor<M>>,
    at: Broadcast,
    band: Band,
    q_start: usize,
    kv_start: usize,
    #[comptime] transposed: bool,
    #[comptime] cfg: TileConfig,
) -> Array<bool> {
    let mut allowed = Array::<bool>::new(cfg.score_regs());
    #[unroll]
    for reg in 0..cfg.score_regs() {
        let first = comptime!(if cfg.mask.per_key {
            cfg.key_reg(reg, transposed)
        } else {
            reg
        });
        if comptime!(first == reg) {
            let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
            allowed[reg] = mask_allows::<M>(mask, at, band, query, key);
        } else {
            allowed[reg] = allowed[first];
        }
    }
    allowed
}

/// Set the scores of the pairs the mask block staged at `staged_base` hides to `fill`
/// (tensor-core forward). A per-key mask's block is one row of keys, read once per key the unit
/// holds; its selects are skipped where every key the plane holds is visible (most blocks of a
/// key-padding mask).
#[cube]
pub fn hide_staged<E: Float, M: Int, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    stages: &Shared<[M]>,
    staged_base: usize,
    fill: f32,
    #[comptime] cfg: TileConfig,
) {
    let chunk = comptime!(cfg.staged.mask.unwrap());
    if comptime!(cfg.mask.per_key) {
        let mut hidden = Array::<bool>::new(cfg.score_regs());
        let mut any_hidden = false;
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let first = comptime!(cfg.key_reg(reg, false));
            if comptime!(first == reg) {
                let (_row, col) = T::score_position(reg, cfg);
                let at = staged_base + input_offset(0usize, col, chunk, cfg);
                hidden[reg] = (stages[at] & M::new(1)) != M::new(0);
                any_hidden = any_hidden || hidden[reg];
            } else {
                hidden[reg] = hidden[first];
            }
        }
        if T::any_unit(any_hidden) {
            #[unroll]
            for reg in 0..cfg.score_regs() {
                scores[reg] = select(hidden[reg], fill, scores[reg]);
            }
        }
    } else {
        // All loads first, then the selects: measured faster than each select after its load.
        let mut hidden = Array::<bool>::new(cfg.score_regs());
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (row, col) = T::score_position(reg, cfg);
            let at = staged_base + input_offset(row, col, chunk, cfg);
            hidden[reg] = (stages[at] & M::new(1)) != M::new(0);
        }
        #[unroll]
        for reg in 0..cfg.score_regs() {
            scores[reg] = select(hidden[reg], fill, scores[reg]);
        }
    }
}

/// Where the row of query block `q_block` of (batch, head) starts in a packed mask's
/// hidden-block flags ([`pack`](super::pack)), if there are any (0 otherwise).
#[cube]
pub fn hidden_row(
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    batch: usize,
    head: usize,
    q_block: usize,
) -> usize {
    let mut row = 0usize;
    #[comptime]
    if let ComptimeOption::Some(flags) = hidden_blocks {
        row = broadcast::<u32>(flags, batch, head).base + q_block * flags.stride(2);
    }
    row
}

/// Blocks `[first, end)` narrowed to those from the first KV block the query block of `row`
/// ([`hidden_row`]) sees by its packed mask to the last; unchanged without one.
#[cube]
pub fn visible_range(
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    row: usize,
    first: usize,
    end: usize,
) -> (usize, usize) {
    let mut range = (first, end);
    #[comptime]
    if let ComptimeOption::Some(flags) = hidden_blocks {
        let blocks = flags.shape(3) - 2;
        range = (
            max(first, usize::cast_from(flags[row + blocks])),
            min(end, usize::cast_from(flags[row + blocks + 1])),
        );
    }
    range
}

/// Whether KV block `block` holds a pair the query block of `row` ([`hidden_row`]) sees by
/// its packed mask; always without one.
#[cube]
pub fn block_visible(
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    row: usize,
    block: usize,
) -> bool {
    let mut visible = true;
    #[comptime]
    if let ComptimeOption::Some(flags) = hidden_blocks {
        visible = flags[row + block] == 0u32;
    }
    visible
}

/// One KV block of a packed mask ([`pack`](super::pack)) as a unit holds it: the words of its
/// rows (`cfg.packed_words()` per row slot, as staged), and whether its plane's rows hide any
/// pair of the block. (Blocks hidden wholly are skipped by the cube before they get here; a
/// plane-level skip of blocks hiding only its rows cost random masks 3-5 % at d 64.)
#[derive(CubeType)]
pub struct PackedBlock {
    words: Array<u32>,
    pub any_hidden: bool,
}

/// The packed mask block staged at `staged_base` in `stages`, where the launch packs its mask;
/// else a placeholder that hides nothing.
#[cube]
pub fn packed_block<E: Float, M: Int, T: AttentionTile<E>>(
    stages: &ComptimeOption<Shared<[M]>>,
    staged_base: usize,
    #[comptime] cfg: TileConfig,
) -> PackedBlock {
    let per_row = comptime!(cfg.packed_words());
    let len = comptime!(if cfg.mask.packed {
        cfg.rows_per_unit() * per_row
    } else {
        1
    });
    let mut words = Array::<u32>::new(len);
    let mut any_hidden = false;
    if comptime!(cfg.mask.packed) {
        #[comptime]
        if let ComptimeOption::Some(stages) = stages {
            // Each slot's row is the first's plus a constant: an immediate offset.
            let first_row = T::slot_row(0usize, cfg);
            let first = smem_anchor(staged_base + first_row * per_row);
            let mut any = 0u32;
            #[unroll]
            for slot in 0..cfg.rows_per_unit() {
                let row_step = T::slot_row(slot, cfg) - first_row;
                #[unroll]
                for w in 0..per_row {
                    let word = u32::cast_from(stages[first + row_step * per_row + w]);
                    words[comptime!(slot * per_row + w)] = word;
                    any |= word;
                }
            }
            any_hidden = T::any_unit(any != 0u32);
        }
    }
    PackedBlock { words, any_hidden }
}

/// Set the scores of the pairs `block` hides to `fill`; nothing to do where its plane's rows
/// hide none. A unit's scores of one row sit at its first column plus a compile-time step
/// ([`TileConfig::score_col_step`]), the first column below 8 and every step at most one past
/// a multiple of 8: shifting a word right by the first column once leaves each score's bit at
/// its step, one constant bit test per score.
#[cube]
pub fn hide_packed<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    block: &PackedBlock,
    fill: f32,
    #[comptime] cfg: TileConfig,
) {
    if block.any_hidden {
        let per_row = comptime!(cfg.packed_words());
        let (_row, first_col) = T::score_position(0usize, cfg);
        let lane_shift = u32::cast_from(first_col);
        let mut hidden = Array::<bool>::new(cfg.score_regs());
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let step = comptime!(cfg.score_col_step(reg));
            let word = block.words[comptime!(cfg.score_slot(reg) * per_row + step / 32)];
            hidden[reg] = ((word >> lane_shift) & comptime!(1u32 << (step % 32))) != 0u32;
        }
        #[unroll]
        for reg in 0..cfg.score_regs() {
            scores[reg] = select(hidden[reg], fill, scores[reg]);
        }
    }
}

/// (query, key) of score register `reg` of the block of queries from `q_start` and keys from
/// `kv_start`; `transposed` when the registers hold (key, query) (the backward owning keys).
#[cube]
pub fn pair_of<E: Float, T: AttentionTile<E>>(
    q_start: usize,
    kv_start: usize,
    #[comptime] reg: usize,
    #[comptime] transposed: bool,
    #[comptime] cfg: TileConfig,
) -> (usize, usize) {
    let (row, col) = T::score_position(reg, cfg);
    if comptime!(transposed) {
        (q_start + col, kv_start + row)
    } else {
        (q_start + row, kv_start + col)
    }
}

/// Add `bias / scale` to the raw scores of the block (`inv_scale = 1 / scale`), if a bias is
/// given and read in place (a staged bias is [`AttentionTile::add_staged`]'s), and ALiBi's
/// `−slope · |key − diagonal| / scale` (`alibi` = `slope / scale`) if `cfg.alibi`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_bias<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    bias: ComptimeOption<&Tensor<E>>,
    at: Broadcast,
    band: Band,
    q_start: usize,
    kv_start: usize,
    inv_scale: f32,
    alibi: f32,
    #[comptime] transposed: bool,
    #[comptime] cfg: TileConfig,
) {
    if comptime!(cfg.alibi) {
        // The signed distance `key − diagonal` is affine in the register's row and column: one
        // product per block at register 0, then per register a constant step (its offset from
        // register 0, which the compiler folds) in one multiply-add and a subtraction of the
        // absolute value. Signed i32 keeps `key + diag_q − query − diag_k` exact.
        let (query0, key0) = pair_of::<E, T>(q_start, kv_start, 0usize, transposed, cfg);
        let (diag_q, diag_k) = diagonal(band, cfg.mask);
        let distance0 = i32::cast_from(key0 + diag_q) - i32::cast_from(query0 + diag_k);
        let base = alibi * f32::cast_from(distance0);
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
            let step = (i32::cast_from(key) - i32::cast_from(key0))
                - (i32::cast_from(query) - i32::cast_from(query0));
            scores[reg] -= (alibi * f32::cast_from(step) + base).abs();
        }
    }
    if comptime!(cfg.staged.bias.is_none()) {
        #[comptime]
        if let ComptimeOption::Some(bias) = bias {
            #[unroll]
            for reg in 0..cfg.score_regs() {
                let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
                scores[reg] += f32::cast_from(bias[element(at, band, query, key)]) * inv_scale;
            }
        }
    }
}

/// `stages` stages of a staged score input's blocks of `len` elements, if `chunk` (its elements
/// per 16 bytes) says it is staged.
#[cube]
pub fn input_stages<N: CubePrimitive>(
    #[comptime] chunk: Option<usize>,
    #[comptime] len: usize,
    #[comptime] stages: usize,
) -> ComptimeOption<Shared<[N]>> {
    if comptime!(chunk.is_some()) {
        let len = comptime!(stages * len);
        ComptimeOption::new_Some(Shared::<[N]>::new_aligned_slice(len, SMEM_ALIGN))
    } else {
        ComptimeOption::new_None()
    }
}

/// Issue asynchronous copies of the `rows × cfg.block_kv` block of a score input (`at` its view
/// of this (batch, head); `rows` is 1 for a mask the same for every query) for the queries from
/// `q_start` and the keys from `kv_start` into `stage[stage_base..]` ([`input_offset`]), `chunk`
/// elements per 16-byte copy. Chunks past either sequence are zero-filled, never read. The
/// launch stages an input only when its rows are 16-byte aligned and `seq_k` a multiple of
/// `chunk`, so a chunk is wholly in or out.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_input_async<N: Numeric>(
    src: &Tensor<N>,
    at: Broadcast,
    band: Band,
    q_start: usize,
    kv_start: usize,
    stage: &mut Shared<[N]>,
    stage_base: usize,
    #[comptime] rows: usize,
    #[comptime] chunk: usize,
    #[comptime] cfg: TileConfig,
) {
    let chunks_per_row = comptime!(cfg.block_kv / chunk);
    let units = comptime!(cfg.units());
    let pass_rows = comptime!(units / chunks_per_row);
    let (rows_per_line, keys) = comptime!(input_swizzle(chunk, &cfg));
    let period = comptime!(rows_per_line * keys);
    if comptime!(
        units.is_multiple_of(chunks_per_row)
            && rows.is_multiple_of(pass_rows)
            && pass_rows.is_multiple_of(period)
    ) {
        // Each pass of the units covers `pass_rows` whole rows: a unit's column and swizzled
        // chunk are the same in every pass, its destination steps by a constant and its source
        // by a constant number of rows, so a copy costs a bound check and an address add.
        let lane_row = UNIT_POS as usize / chunks_per_row;
        let col = UNIT_POS as usize % chunks_per_row * chunk;
        let key_in_bounds = kv_start + col < band.seq_k;
        let lane_src = at.base + (q_start + lane_row) * at.row_stride + kv_start + col;
        let pass_src = comptime!(pass_rows) * at.row_stride;
        let lane_dst = smem_anchor(stage_base + input_offset(lane_row, col, chunk, cfg));
        #[unroll]
        for pass in 0..comptime!(rows / pass_rows) {
            let in_bounds =
                key_in_bounds && q_start + lane_row + comptime!(pass * pass_rows) < band.seq_q;
            let src_start = select(in_bounds, lane_src + comptime!(pass) * pass_src, 0usize);
            let dst = lane_dst + comptime!(pass * pass_rows * cfg.block_kv);
            copy_or_zero_fill(src, src_start, in_bounds, stage, dst, chunk);
        }
    } else {
        let chunks = comptime!(rows * chunks_per_row);
        #[unroll]
        for pass in 0..comptime!(chunks.div_ceil(units)) {
            let id = comptime!(pass * units) + UNIT_POS as usize;
            if comptime!(chunks.is_multiple_of(units)) || id < chunks {
                let row = id / chunks_per_row;
                let col = id % chunks_per_row * chunk;
                let (query, key) = (q_start + row, kv_start + col);
                let in_bounds = query < band.seq_q && key < band.seq_k;
                let src_start = select(in_bounds, at.base + query * at.row_stride + key, 0usize);
                let dst = stage_base + input_offset(row, col, chunk, cfg);
                copy_or_zero_fill(src, src_start, in_bounds, stage, dst, chunk);
            }
        }
    }
}

/// Issue asynchronous copies of the packed mask's words ([`pack`](super::pack)) for the queries
/// from `q_start` and the keys from `kv_start` (one KV block, `at` the view of this (batch,
/// head) whose row stride steps KV blocks) into `stage[stage_base..]`: a contiguous run of
/// `cfg.mask_stage_len()` words, 4 per 16-byte copy, in bounds for every query block.
#[cube]
pub fn copy_packed_async<M: Int>(
    packed: &Tensor<M>,
    at: Broadcast,
    q_start: usize,
    kv_start: usize,
    stage: &mut Shared<[M]>,
    stage_base: usize,
    #[comptime] cfg: TileConfig,
) {
    let chunks = comptime!(cfg.mask_stage_len() / 4);
    let units = comptime!(cfg.units());
    let src = at.base + kv_start / cfg.block_kv * at.row_stride + q_start * cfg.packed_words();
    #[unroll]
    for pass in 0..comptime!(chunks.div_ceil(units)) {
        let id = comptime!(pass * units) + UNIT_POS as usize;
        if comptime!(chunks.is_multiple_of(units)) || id < chunks {
            let offset = id * 4;
            copy_whole(packed, src + offset, stage, stage_base + offset, 4usize);
        }
    }
}

/// Issue the asynchronous copies of the staged inputs' blocks for the queries from `q_start`
/// and the keys from `kv_start` into stage `stage` (0 or 1); a single-stage bias is left to
/// [`fetch_bias`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_inputs<E: Float, M: Int>(
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    mask_stages: &mut ComptimeOption<Shared<[M]>>,
    bias_stages: &mut ComptimeOption<Shared<[E]>>,
    views: Views,
    band: Band,
    q_start: usize,
    kv_start: usize,
    stage: usize,
    #[comptime] cfg: TileConfig,
) {
    #[comptime]
    if let ComptimeOption::Some(stages) = mask_stages {
        #[comptime]
        if let ComptimeOption::Some(mask) = mask {
            let chunk = comptime!(cfg.staged.mask.unwrap());
            let base = stage * comptime!(cfg.mask_stage_len());
            if comptime!(cfg.mask.packed) {
                copy_packed_async::<M>(mask, views.mask, q_start, kv_start, stages, base, cfg);
            } else {
                let rows = comptime!(cfg.mask_rows());
                copy_input_async::<M>(
                    mask, views.mask, band, q_start, kv_start, stages, base, rows, chunk, cfg,
                );
            }
        }
    }
    if comptime!(!cfg.staged.bias_single) {
        fetch_bias::<E>(
            bias,
            bias_stages,
            views,
            band,
            q_start,
            kv_start,
            stage * comptime!(cfg.block_q * cfg.block_kv),
            cfg,
        );
    }
}

/// Issue the asynchronous copies of the staged bias block for the queries from `q_start` and
/// the keys from `kv_start` to `base` in `bias_stages`, if the bias is staged.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_bias<E: Float>(
    bias: ComptimeOption<&Tensor<E>>,
    bias_stages: &mut ComptimeOption<Shared<[E]>>,
    views: Views,
    band: Band,
    q_start: usize,
    kv_start: usize,
    base: usize,
    #[comptime] cfg: TileConfig,
) {
    #[comptime]
    if let ComptimeOption::Some(stages) = bias_stages {
        #[comptime]
        if let ComptimeOption::Some(bias) = bias {
            let chunk = comptime!(cfg.staged.bias.unwrap());
            copy_input_async::<E>(
                bias,
                views.bias,
                band,
                q_start,
                kv_start,
                stages,
                base,
                cfg.block_q,
                chunk,
                cfg,
            );
        }
    }
}

/// ALiBi's slope of query head `head` (Press et al.'s slopes for `heads` heads, `pow2` the
/// largest power of two not above `heads`): `2^(−8 (h + 1) / pow2)` for the first `pow2` heads,
/// then every other slope of `2 · pow2` heads, `2^(−4 (2 (h − pow2) + 1) / pow2)`.
#[cube]
pub fn alibi_slope(head: usize, pow2: u32) -> f32 {
    let c = f32::cast_from(pow2);
    let h = f32::cast_from(head);
    let exponent = select(
        head < usize::cast_from(pow2),
        -8.0f32 * (h + 1.0) / c,
        -4.0f32 * (2.0 * (h - c) + 1.0) / c,
    );
    (exponent * core::f32::consts::LN_2).exp()
}

/// Write the scores' gradient of the block (queries in rows) into `d_bias`
/// (`[b, h, seq_q, seq_k]` contiguous), if it is asked for.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_bias_grad<E: Float, T: AttentionTile<E>>(
    grads: &Array<f32>,
    d_bias: &mut ComptimeOption<&mut Tensor<E>>,
    batch: usize,
    head: usize,
    band: Band,
    q_start: usize,
    kv_start: usize,
    #[comptime] cfg: TileConfig,
) {
    #[comptime]
    if let ComptimeOption::Some(d_bias) = d_bias {
        // Method calls reach the tensor through the option's reference; an argument could not.
        let base = batch * d_bias.stride(0) + head * d_bias.stride(1);
        let row_stride = d_bias.stride(2);
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, false, cfg);
            if query < band.seq_q && key < band.seq_k {
                d_bias[base + query * row_stride + key] = E::cast_from(grads[reg]);
            }
        }
    }
}

/// The views of (batch, head) in the mask and the bias inputs (unused where absent).
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Views {
    pub mask: Broadcast,
    pub bias: Broadcast,
}

#[cube]
impl Views {
    pub fn new<E: Float, M: Int>(
        mask: ComptimeOption<&Tensor<M>>,
        bias: ComptimeOption<&Tensor<E>>,
        batch: usize,
        head: usize,
    ) -> Views {
        let mut mask_base = 0usize;
        let mut mask_row = 0usize;
        let mut bias_base = 0usize;
        let mut bias_row = 0usize;
        #[comptime]
        if let ComptimeOption::Some(mask) = mask {
            let at = broadcast::<M>(mask, batch, head);
            mask_base = at.base;
            mask_row = at.row_stride;
        }
        #[comptime]
        if let ComptimeOption::Some(bias) = bias {
            let at = broadcast::<E>(bias, batch, head);
            bias_base = at.base;
            bias_row = at.row_stride;
        }
        Views {
            mask: Broadcast {
                base: mask_base,
                row_stride: mask_row,
            },
            bias: Broadcast {
                base: bias_base,
                row_stride: bias_row,
            },
        }
    }
}
