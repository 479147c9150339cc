//! Global level of the forward: one cube per (query block, head, batch). The cube loads its
//! query block once, walks the KV blocks its band lets it see (from the sliding window's left
//! edge to the causal diagonal; with a packed mask, only from the first block the mask lets it
//! see to the last, skipping those it hides wholly), and writes the normalised output and the
//! per-row log-sum-exp.
//! Grouped-query attention reads the key/value head `head / group` of its query head. With
//! per-sequence key lengths (a cache's filled parts), each sequence's band ends at its length;
//! with a block table, its key blocks are read from the pages the table maps them to. A mask or
//! bias input is read where each score register sits ([`inputs`](crate::kernel::inputs));
//! dropout drops probabilities after the softmax statistics saw them, so the normaliser and the
//! log-sum-exp are those of the full row.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::layout::Layout;
use super::pages::{BlockRows, block_page, block_rows, key_capacity};
use crate::kernel::band::{Band, kv_blocks};
use crate::kernel::config::{SMEM_ALIGN, TMA_ALIGN, TileConfig, TilePath};
use crate::kernel::dropout::{Dropout, keep_mask};
use crate::kernel::grid::{BlockWalk, batch_and_head, block_and_split, row_block};
use crate::kernel::inputs::{
    Views, add_bias, alibi_slope, block_visible, fetch_bias, fetch_inputs, hidden_row, hide_packed,
    input_stages, packed_block, visible_range,
};
use crate::kernel::mask::apply_mask;
use crate::kernel::softmax::{
    RowStats, Softcap, finish, init_stats, online_update, softcap_scores,
};
use crate::kernel::stage::{
    StageBarriers, fetch_stage, fetch_stage_tma, load_block, zero_rows_from,
};
use crate::kernel::tile::AttentionTile;

/// Where the cube reads and writes, and the lengths that bound it.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Coords {
    /// The batch index into the tensors (0 for packed sequences, which are one batch).
    batch: usize,
    /// The first key row of the sequence in its tensors (packed sequences; else 0).
    k_row: usize,
    /// The tensors' dims and strides.
    layout: Layout,
    /// The key/value head this query head reads (GQA).
    kv_head: usize,
    q_base: usize,
    k_base: usize,
    v_base: usize,
    q_start: usize,
    band: Band,
    softcap: Softcap,
    /// Where this (batch, head) reads the mask and bias inputs.
    views: Views,
    /// Where this query block's row of the packed mask's hidden-block flags starts.
    hidden_row: usize,
    dropout: Dropout,
    /// Dropout's key of this (batch, head).
    head_key: u32,
    /// ALiBi's slope of this head over the scale.
    alibi: f32,
    inv_scale: f32,
    /// `-inf`, passed in because WGSL has no literal for it.
    neg_inf: f32,
}

#[cube(
    launch_unchecked,
    create_dummy_kernel,
    address_type = "dynamic",
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<E: Float, M: Int, I: Int, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    k_map: &ComptimeOption<TensorMap<E, Tiled>>,
    v_map: &ComptimeOption<TensorMap<E, Tiled>>,
    mask: ComptimeOption<&Tensor<M>>,
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    bias: ComptimeOption<&Tensor<E>>,
    key_lengths: ComptimeOption<&Tensor<I>>,
    block_table: ComptimeOption<&Tensor<I>>,
    layout: Layout,
    starts: ComptimeOption<&Tensor<u32>>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    scale: f32,
    band_left: u32,
    band_right: u32,
    softcap: f32,
    neg_inf: f32,
    dropout_seed_lo: u32,
    dropout_seed_hi: u32,
    dropout_threshold: u32,
    alibi_pow2: u32,
    #[comptime] cfg: TileConfig,
    #[define(E, M, I)] _dtypes: [ElemType; 3],
) {
    // With packed sequences the grid's batch is the sequence, the tensors' batch is 0.
    let (sequence, head) = batch_and_head(cfg);
    let batch = if comptime!(cfg.varlen.0) {
        usize::new(0)
    } else {
        sequence
    };
    let band = Band::new(
        layout.seq_q,
        key_capacity(block_table, layout),
        band_left,
        band_right,
    )
    .of_sequence(key_lengths, batch);
    let (band, q_row, k_row) = band.of_packed(starts, sequence);
    let kv_head = head / (layout.heads / layout.kv_heads);
    let dropout = Dropout::new(
        dropout_seed_lo,
        dropout_seed_hi,
        dropout_threshold,
        layout.heads,
        layout.key_rows,
    );
    // With split keys, `out` holds a head per (split, query head).
    let (block, split) = if comptime!(cfg.kv_split.0) {
        block_and_split(layout.splits, cfg)
    } else {
        (row_block(cfg), 0usize)
    };
    let coords = Coords {
        batch,
        k_row,
        layout,
        kv_head,
        q_base: batch * layout.q.outer + head * layout.q.head + q_row * layout.q.row,
        k_base: batch * layout.k.outer + kv_head * layout.k.head,
        v_base: batch * layout.v.outer + kv_head * layout.v.head,
        q_start: block * cfg.block_q,
        band,
        softcap: Softcap::new(scale, softcap),
        views: Views::new::<E, M>(mask, bias, batch, head),
        hidden_row: hidden_row(hidden_blocks, batch, head, block),
        dropout,
        head_key: dropout.head_key(sequence, head),
        alibi: alibi_slope(head, alibi_pow2) / scale,
        inv_scale: 1.0 / scale,
        neg_inf,
    };

    // Scores softcapped with nothing added after the cap stay tanh(inner · s): the cap's outer
    // factor rides in the softmax scale, one multiply per score fewer.
    let scale = if comptime!(cfg.softcap_outer_in_scale()) {
        scale * coords.softcap.outer
    } else {
        scale
    };
    // The band's blocks, narrowed to those a packed mask lets the query block see: read first,
    // so that the read's latency passes while the stages are set up.
    let (first, end) = kv_blocks(coords.band, coords.q_start, cfg);
    // A packed sequence shorter than the longest has row blocks past its end: they walk nothing.
    let (first, end) = if comptime!(cfg.varlen.0) {
        (
            first,
            select(coords.q_start < coords.band.seq_q, end, first),
        )
    } else {
        (first, end)
    };
    let (first, end) = visible_range(hidden_blocks, coords.hidden_row, first, end);
    let walk = if comptime!(cfg.kv_split.0) {
        BlockWalk::split(first, end, split, layout.splits, comptime!(!cfg.paged.0))
    } else {
        BlockWalk::all(first, end)
    };
    let mut stats = init_stats(neg_inf, cfg);
    let mut acc = Array::<f32>::new(cfg.out_regs());
    #[unroll]
    for reg in 0..cfg.out_regs() {
        acc[reg] = 0.0;
    }

    let mut query = if comptime!(cfg.tile == TilePath::TensorCore) {
        kv_loop_pipelined::<E, M, I, T>(
            q,
            k,
            v,
            k_map,
            v_map,
            mask,
            hidden_blocks,
            bias,
            block_table,
            coords,
            walk,
            scale,
            &mut stats,
            &mut acc,
            cfg,
        )
    } else {
        kv_loop::<E, M, I, T>(
            q,
            k,
            v,
            mask,
            bias,
            block_table,
            coords,
            walk,
            scale,
            &mut stats,
            &mut acc,
            cfg,
        )
    };

    let (mut inv_sum, row_lse) = finish::<E, T>(&stats, scale, neg_inf, cfg);
    if comptime!(cfg.dropout) {
        #[unroll]
        for slot in 0..cfg.rows_per_unit() {
            inv_sum[slot] *= coords.dropout.scale;
        }
    }
    #[unroll]
    for reg in 0..cfg.out_regs() {
        acc[reg] *= inv_sum[comptime!(cfg.out_slot(reg))];
    }
    let out_head = if comptime!(cfg.kv_split.0) {
        split * layout.heads + head
    } else {
        head
    };
    let out_base = batch * layout.out.outer + out_head * layout.out.head + q_row * layout.out.row;
    if comptime!(cfg.value_stride() <= cfg.head_stride()) {
        // The query block is done with: its shared memory stages the output rows.
        T::store_owned(
            &mut query,
            &acc,
            1.0,
            out,
            out_base,
            layout.out.row,
            coords.q_start,
            coords.band.seq_q,
            cfg,
        );
    } else {
        // Values wider than queries: the output does not fit in the query block.
        let out_row = layout.out.row;
        #[unroll]
        for reg in 0..cfg.out_regs() {
            let (row, col) = T::out_position(reg, cfg);
            let query_row = coords.q_start + row;
            if query_row < coords.band.seq_q {
                out[out_base + query_row * out_row + col] = E::cast_from(acc[reg]);
            }
        }
    }
    if T::writes_row_stats() {
        let lse_row = layout.lse.row;
        let lse_base = batch * layout.lse.outer + out_head * layout.lse.head + q_row * lse_row;
        #[unroll]
        for slot in 0..cfg.rows_per_unit() {
            let query_row = coords.q_start + T::slot_row(slot, cfg);
            if query_row < coords.band.seq_q {
                lse[lse_base + query_row * lse_row] = row_lse[slot];
            }
        }
    }
}

/// Scores, bias, masking, online softmax and P·V for the KV block staged at `stage` (with its
/// mask and bias blocks, where those are staged; a single-stage bias block lands on
/// `bias_ready` while the scores are computed).
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_block<E: Float, M: Int, T: AttentionTile<E>>(
    query: &T::Query,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    mask_stages: &ComptimeOption<Shared<[M]>>,
    bias_stages: &ComptimeOption<Shared<[E]>>,
    bias_ready: &ComptimeOption<Shared<Barrier>>,
    keys: &Shared<[E]>,
    values: &Shared<[E]>,
    stage: usize,
    kv_start: usize,
    coords: Coords,
    bias_factor: &T::StagedFactor,
    scale: f32,
    stats: &mut RowStats,
    acc: &mut Array<f32>,
    #[comptime] cfg: TileConfig,
) {
    let packed = packed_block::<E, M, T>(mask_stages, stage * comptime!(cfg.mask_stage_len()), cfg);
    let mut scores = T::scores(query, keys, stage * cfg.block_kv * cfg.head_stride(), cfg);
    if comptime!(cfg.softcap) {
        softcap_scores(
            &mut scores,
            coords.softcap,
            cfg.score_regs(),
            cfg.softcap_outer_in_scale(),
        );
    }
    #[comptime]
    if let ComptimeOption::Some(ready) = bias_ready {
        ready.arrive_and_wait();
    }
    #[comptime]
    if let ComptimeOption::Some(stages) = bias_stages {
        let bias_stage = stage % comptime!(cfg.staged.bias_stages());
        T::add_staged(
            &mut scores,
            stages,
            bias_stage * comptime!(cfg.block_q * cfg.block_kv),
            bias_factor,
            cfg,
        );
    }
    add_bias::<E, T>(
        &mut scores,
        bias,
        coords.views.bias,
        coords.band,
        coords.q_start,
        kv_start,
        coords.inv_scale,
        coords.alibi,
        false,
        cfg,
    );
    apply_mask::<E, M, T>(
        &mut scores,
        mask,
        mask_stages,
        stage * comptime!(cfg.mask_stage_len()),
        coords.views.mask,
        coords.band,
        coords.q_start,
        kv_start,
        coords.neg_inf,
        cfg,
    );
    if comptime!(cfg.mask.packed) {
        hide_packed::<E, T>(&mut scores, &packed, coords.neg_inf, cfg);
    }
    online_update::<E, T>(&mut scores, stats, acc, scale, coords.neg_inf, cfg);
    if comptime!(cfg.dropout) {
        let keep = keep_mask::<E, T>(
            &coords.dropout,
            coords.head_key,
            coords.q_start,
            kv_start,
            false,
            cfg,
        );
        #[unroll]
        for reg in 0..cfg.score_regs() {
            scores[reg] = select(keep[reg], scores[reg], 0.0);
        }
    }
    T::accumulate(
        &scores,
        values,
        stage * cfg.block_kv * cfg.value_stride(),
        acc,
        cfg,
    );
}

/// The blocks of `walk` through a ring of shared-memory stages filled by asynchronous copies (K
/// and V by `k_map` and `v_map` with `cfg.tma`): while one block is computed, the walk's next
/// (two, with [`three_kv_stages`](TileConfig::three_kv_stages)) are in flight, with their
/// staged mask and bias blocks. The query block loads while the first KV blocks are in flight;
/// it is returned for the epilogue. Blocks a packed mask hides wholly from the query block are
/// neither fetched nor computed; their iterations only keep the stages' barriers in step.
#[cube]
#[allow(clippy::too_many_arguments)]
fn kv_loop_pipelined<E: Float, M: Int, I: Int, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    k_map: &ComptimeOption<TensorMap<E, Tiled>>,
    v_map: &ComptimeOption<TensorMap<E, Tiled>>,
    mask: ComptimeOption<&Tensor<M>>,
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    bias: ComptimeOption<&Tensor<E>>,
    block_table: ComptimeOption<&Tensor<I>>,
    coords: Coords,
    walk: BlockWalk,
    scale: f32,
    stats: &mut RowStats,
    acc: &mut Array<f32>,
    #[comptime] cfg: TileConfig,
) -> T::Query {
    // Blocks in flight ahead of the one computed.
    let ahead = comptime!(cfg.kv_stages() - 1);
    // A packed mask's block flags and a paged block's table entry are read an iteration before
    // the one that fetches the block (the first blocks' entries before the stages are set up),
    // so that a load lands behind a block's products, not in front of the next fetch. Reads
    // are clamped into the walk (the kernel's `&&` evaluates both sides).
    let count = walk.count();
    let last = walk.last();
    let first = walk.first;
    let step = walk.step;
    let page_first = page_of::<I>(block_table, coords, min(first, last), cfg);
    let stage_align = comptime!(if cfg.tma { TMA_ALIGN } else { SMEM_ALIGN });
    let mut keys = Shared::<[E]>::new_aligned_slice(
        comptime!(cfg.kv_stages() * cfg.block_kv * cfg.head_stride()),
        stage_align,
    );
    let mut values = Shared::<[E]>::new_aligned_slice(
        comptime!(cfg.kv_stages() * cfg.block_kv * cfg.value_stride()),
        stage_align,
    );
    let mut mask_stages = input_stages::<M>(cfg.staged.mask, cfg.mask_stage_len(), 2usize);
    let mut bias_stages = input_stages::<E>(
        cfg.staged.bias,
        cfg.block_q * cfg.block_kv,
        cfg.staged.bias_stages(),
    );
    let barriers = StageBarriers::new(cfg.kv_stages());
    if comptime!(cfg.tma) {
        // The copy engine completes on the barriers: their initialisation must be visible to it.
        sync_async_proxy_shared();
    }
    let bias_ready = single_bias_barrier(cfg);
    let bias_factor = T::staged_factor(coords.inv_scale, cfg);
    sync_cube();

    // Three stages take no packed mask (`TileConfig::with_three_kv_stages`): every block of
    // their walk is visible, and only two stages keep flags.
    let row = coords.hidden_row;
    let mut visible = count > 0 && block_visible(hidden_blocks, row, min(first, last));
    let mut visible_next = block_visible(hidden_blocks, row, min(first + step, last));
    if visible {
        fetch_block::<E, M>(
            k,
            v,
            k_map,
            v_map,
            mask,
            bias,
            coords,
            &mut keys,
            &mut values,
            &mut mask_stages,
            &mut bias_stages,
            rows_of::<I>(block_table, coords, page_first, first, cfg),
            first,
            0,
            &barriers,
            cfg,
        );
    }
    if comptime!(ahead > 1) {
        let second = first + step;
        if count > 1 {
            let page_second = page_of::<I>(block_table, coords, second, cfg);
            fetch_block::<E, M>(
                k,
                v,
                k_map,
                v_map,
                mask,
                bias,
                coords,
                &mut keys,
                &mut values,
                &mut mask_stages,
                &mut bias_stages,
                rows_of::<I>(block_table, coords, page_second, second, cfg),
                second,
                1,
                &barriers,
                cfg,
            );
        }
    }
    let mut page_next = page_of::<I>(block_table, coords, min(first + ahead * step, last), cfg);
    let query = query_block::<E, T>(q, coords, cfg);
    for i in 0..count {
        let block = walk.block(i);
        let stage = i % cfg.kv_stages();
        barriers.wait(stage);
        if comptime!(cfg.tma && (cfg.key_lengths.0 || cfg.varlen.0)) {
            zero_value_tail::<E>(
                &mut values,
                stage,
                block * cfg.block_kv,
                coords.band.seq_k,
                cfg,
            );
        }
        let visible_after = block_visible(hidden_blocks, row, min(block + 2 * step, last));
        // Every unit is past the previous block: a single-stage bias may be refilled. Its
        // copies are issued before the next block's, which its barrier must not wait for.
        if visible {
            fetch_single_bias::<E>(
                bias,
                &mut bias_stages,
                &bias_ready,
                coords,
                block * cfg.block_kv,
                cfg,
            );
        }
        // The stage computed in the previous iteration is free again: the block `ahead` on
        // fills it.
        let fetched = block + ahead * step;
        if i + ahead < count && visible_next {
            fetch_block::<E, M>(
                k,
                v,
                k_map,
                v_map,
                mask,
                bias,
                coords,
                &mut keys,
                &mut values,
                &mut mask_stages,
                &mut bias_stages,
                rows_of::<I>(block_table, coords, page_next, fetched, cfg),
                fetched,
                (i + ahead) % cfg.kv_stages(),
                &barriers,
                cfg,
            );
        }
        page_next = page_of::<I>(block_table, coords, min(fetched + step, last), cfg);
        if visible {
            attend_block::<E, M, T>(
                &query,
                mask,
                bias,
                &mask_stages,
                &bias_stages,
                &bias_ready,
                &keys,
                &values,
                stage,
                block * cfg.block_kv,
                coords,
                &bias_factor,
                scale,
                stats,
                acc,
                cfg,
            );
        }
        visible = visible_next;
        visible_next = visible_after;
    }
    query
}

/// With per-sequence key lengths and tensor maps, zero the rows of the value stage `stage`
/// (keys from `kv_start`) past the sequence's `seq_k` keys: the map's box read them as the
/// cache holds them ([`zero_rows_from`]). Only the block that holds the sequence's end has any;
/// the branch is the same for the whole cube.
#[cube]
fn zero_value_tail<E: Float>(
    values: &mut Shared<[E]>,
    stage: usize,
    kv_start: usize,
    seq_k: usize,
    #[comptime] cfg: TileConfig,
) {
    if kv_start + cfg.block_kv > seq_k {
        zero_rows_from::<E>(
            values,
            stage * comptime!(cfg.block_kv * cfg.value_stride()),
            seq_k - kv_start,
            cfg.block_kv,
            cfg.value_stride(),
            comptime!(cfg.staged_pitch(cfg.value_stride())),
            cfg.units(),
        );
        // The copy engine refills this stage once the ring comes round: order these writes
        // first.
        sync_async_proxy_shared();
        sync_cube();
    }
}

/// Issue the asynchronous copies of KV block `block` (its keys and values from `rows`, and its
/// blocks of the staged mask and bias) into stage `stage`, completing on that stage's barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_block<E: Float, M: Int>(
    k: &Tensor<E>,
    v: &Tensor<E>,
    k_map: &ComptimeOption<TensorMap<E, Tiled>>,
    v_map: &ComptimeOption<TensorMap<E, Tiled>>,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    coords: Coords,
    keys: &mut Shared<[E]>,
    values: &mut Shared<[E]>,
    mask_stages: &mut ComptimeOption<Shared<[M]>>,
    bias_stages: &mut ComptimeOption<Shared<[E]>>,
    rows: BlockRows,
    block: usize,
    stage: usize,
    barriers: &StageBarriers,
    #[comptime] cfg: TileConfig,
) {
    let kv_start = block * cfg.block_kv;
    #[comptime]
    if let (ComptimeOption::Some(k_map), ComptimeOption::Some(v_map)) = (k_map, v_map) {
        fetch_stage_tma::<E>(
            k_map,
            v_map,
            rows.outer,
            coords.kv_head,
            rows.first,
            keys,
            values,
            stage,
            barriers,
            cfg,
        );
    } else {
        fetch_stage::<E>(
            k,
            rows.k_base,
            coords.layout.k.row,
            v,
            rows.v_base,
            coords.layout.v.row,
            rows.first,
            rows.end,
            keys,
            values,
            stage,
            cfg,
        );
    }
    fetch_inputs::<E, M>(
        mask,
        bias,
        mask_stages,
        bias_stages,
        coords.views,
        coords.band,
        coords.q_start,
        kv_start,
        stage,
        cfg,
    );
    barriers.commit(stage);
}

/// The cube's query block, loaded by the tile.
#[cube]
fn query_block<E: Float, T: AttentionTile<E>>(
    q: &Tensor<E>,
    coords: Coords,
    #[comptime] cfg: TileConfig,
) -> T::Query {
    T::load_query(
        q,
        coords.q_base,
        coords.layout.q.row,
        coords.q_start,
        coords.band.seq_q,
        cfg,
    )
}

/// The page KV block `block` of the cube's sequence lies in ([`block_page`]).
#[cube]
fn page_of<I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    coords: Coords,
    block: usize,
    #[comptime] cfg: TileConfig,
) -> usize {
    block_page::<I>(
        block_table,
        coords.layout.pages,
        coords.batch,
        block * cfg.block_kv,
        coords.band.seq_k,
    )
}

/// The rows KV block `block` of the cube's head is read from in `page` ([`block_rows`]).
#[cube]
fn rows_of<I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    coords: Coords,
    page: usize,
    block: usize,
    #[comptime] cfg: TileConfig,
) -> BlockRows {
    block_rows::<I>(
        block_table,
        coords.layout,
        page,
        coords.kv_head,
        coords.k_base,
        coords.v_base,
        block * cfg.block_kv,
        coords.band.seq_k,
    )
    .shifted(coords.k_row)
}

/// Issue the copies of the single-stage bias block of the keys from `kv_start`, completing on
/// `bias_ready`, if the bias is staged that way.
#[cube]
fn fetch_single_bias<E: Float>(
    bias: ComptimeOption<&Tensor<E>>,
    bias_stages: &mut ComptimeOption<Shared<[E]>>,
    bias_ready: &ComptimeOption<Shared<Barrier>>,
    coords: Coords,
    kv_start: usize,
    #[comptime] cfg: TileConfig,
) {
    #[comptime]
    if let ComptimeOption::Some(ready) = bias_ready {
        fetch_bias::<E>(
            bias,
            bias_stages,
            coords.views,
            coords.band,
            coords.q_start,
            kv_start,
            0usize,
            cfg,
        );
        ready.commit_copy_async();
    }
}

/// The barrier a single-stage bias block lands on, if the bias is staged that way.
#[cube]
fn single_bias_barrier(#[comptime] cfg: TileConfig) -> ComptimeOption<Shared<Barrier>> {
    if comptime!(cfg.staged.bias.is_some() && cfg.staged.bias_single) {
        ComptimeOption::new_Some(Barrier::shared(CUBE_DIM, UNIT_POS == 0))
    } else {
        ComptimeOption::new_None()
    }
}

/// The blocks of `walk` through one shared-memory stage filled by plain loads, the cube
/// synchronised around it; the query rows are returned for the epilogue.
#[cube]
#[allow(clippy::too_many_arguments)]
fn kv_loop<E: Float, M: Int, I: Int, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    block_table: ComptimeOption<&Tensor<I>>,
    coords: Coords,
    walk: BlockWalk,
    scale: f32,
    stats: &mut RowStats,
    acc: &mut Array<f32>,
    #[comptime] cfg: TileConfig,
) -> T::Query {
    let query = query_block::<E, T>(q, coords, cfg);
    let bias_factor = T::staged_factor(coords.inv_scale, cfg);
    let mut keys = Shared::<[E]>::new_slice(cfg.block_kv * cfg.head_dim);
    let mut values = Shared::<[E]>::new_slice(cfg.block_kv * cfg.value_dim);
    for i in 0..walk.count() {
        let block = walk.block(i);
        let first_row = block * cfg.block_kv;
        let page = page_of::<I>(block_table, coords, block, cfg);
        let rows = rows_of::<I>(block_table, coords, page, block, cfg);
        sync_cube();
        load_block::<E>(
            k,
            rows.k_base,
            rows.first,
            rows.end,
            &mut keys,
            cfg.block_kv,
            cfg.head_dim,
            cfg.units(),
            cfg.swizzle(),
        );
        load_block::<E>(
            v,
            rows.v_base,
            rows.first,
            rows.end,
            &mut values,
            cfg.block_kv,
            cfg.value_dim,
            cfg.units(),
            cfg.swizzle(),
        );
        sync_cube();
        attend_block::<E, M, T>(
            &query,
            mask,
            bias,
            &ComptimeOption::new_None(),
            &ComptimeOption::new_None(),
            &ComptimeOption::new_None(),
            &keys,
            &values,
            0,
            first_row,
            coords,
            &bias_factor,
            scale,
            stats,
            acc,
            cfg,
        );
    }
    query
}
