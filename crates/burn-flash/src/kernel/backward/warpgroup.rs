//! The backward on Hopper's warpgroup products (SM90a): dK and dV of a block of keys, and its
//! share of dQ by f32 atomics, every product a `wgmma` ([`wgmma`](crate::kernel::tile::wgmma))
//! on shared-memory tiles the copy engine fills (tensor maps, 128-byte swizzle).
//!
//! A cube owns 64 keys per warpgroup (two warpgroups: 128 keys) and their values, loaded once,
//! and walks the query blocks of 64 rows that see them, for each query head of its key/value
//! head's group, Q and dO in a ring of three stages. Per block, each warpgroup runs
//! `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (the forward's first product), recomputes `Pᵀ` from the
//! forward's log-sum-exp and `dSᵀ = Pᵀ ∘ (dPᵀ − D)` (both statistics loaded a block ahead),
//! accumulates `dV += Pᵀ·dO` and `dK += dSᵀ·Q` with the probabilities and `dSᵀ` from registers
//! (the forward's second product) and, with the atomic dQ, stages `dSᵀ` in shared memory (two
//! buffers) and, after a barrier of both warpgroups, adds `dQ += dS·K` over the cube's 128 keys,
//! its half of the columns, to dQ's f32 accumulator (the product across rows; four columns an
//! atomic add). With the deterministic dQ the tensor-core tile's dQ launch follows instead. No
//! unit is a producer only: the cube's first unit issues the copies, refilling a stage once
//! every unit released it, so the warpgroups keep every register
//! (the accumulators of dK, dV and dQ and two score tiles need more than the 168 a unit that a
//! producer's extra warp would leave).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::kernel::config::{ScoreParams, TilePath, WarpgroupBackwardConfig};
use crate::kernel::forward::warpgroup::{diagonal_bound, load_panels, tensor_map};
use crate::kernel::softmax::exp2;
use crate::kernel::tensors::KernelTensor;
use crate::kernel::tile::wgmma::{
    descriptor, descriptor_across_rows, position, product, product_across_rows, product_pv,
    swizzled, wait_products,
};

/// A unit's accumulators of a 64 × 64 f32 tile (keys × queries).
type Tile = Vector<f32, Const<32>>;
/// A unit's registers of a 64 × 64 tile of 16-bit values as the A operand of a product over
/// the 64 queries (4 k-steps of 4).
type Fragment = Vector<u32, Const<16>>;
/// A per-query statistic of the 16 columns a unit holds of a 64 × 64 tile.
type Stats = Vector<f32, Const<16>>;
/// One barrier per stage of the Q and dO ring.
type Ring = (Shared<Barrier>, Shared<Barrier>, Shared<Barrier>);

/// Enqueue the dK/dV launch of contiguous `q`, `d_out: [b, h, sq, d]` and `k`, `v:
/// [b, hkv, sk, d]` (rows readable by tensor maps), with the forward's `lse: [b, h, sq]`
/// (natural log) and `delta = rowsum(dO ∘ O)`, writing `d_k`, `d_v` and, with `cfg.atomic_dq`,
/// adding `dS·K` (unscaled) to `d_q_accum: [b, h, sq, d]` f32, contiguous and zeroed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    q: &KernelTensor,
    k: &KernelTensor,
    v: &KernelTensor,
    d_out: &KernelTensor,
    lse: &KernelTensor,
    delta: &KernelTensor,
    d_k: &KernelTensor,
    d_v: &KernelTensor,
    d_q_accum: Option<&KernelTensor>,
    params: &ScoreParams,
    cfg: WarpgroupBackwardConfig,
) {
    assert_eq!(
        cfg.atomic_dq,
        d_q_accum.is_some(),
        "the atomic dQ's blocks take its accumulator, the others none"
    );
    let dims = q.meta.shape();
    let (batch, heads, seq_q) = (dims[0], dims[1], dims[2]);
    let (kv_heads, seq_k) = (k.meta.shape()[1], k.meta.shape()[2]);
    assert!(
        matches!(cfg.head_dim, 64 | 128),
        "the plan takes the warpgroup backward at head dims 64 and 128, not {}",
        cfg.head_dim
    );
    if seq_k == 0 {
        return;
    }
    let map =
        |t: &KernelTensor, rows: usize| tensor_map(t.clone().into_tensor_arg(), t.dtype, rows);
    let cube_count = CubeCount::Static(
        seq_k.div_ceil(cfg.block_k()) as u32,
        kv_heads as u32,
        batch as u32,
    );
    // SAFETY: the tensor maps bound every read (rows past a sequence arrive as zeros); the
    // kernel reads `lse` and `delta` at rows below `seq_q`, writes rows below `seq_k` of `d_k`
    // and `d_v` and adds to rows below `seq_q` of `d_q_accum`, all allocated by the caller from
    // the inputs' shapes, whose indices the caller checked fit 32 bits.
    unsafe {
        warpgroup_key_value_grads::launch_unchecked(
            &q.client,
            cube_count,
            CubeDim::new_1d(cfg.units() as u32),
            // The accumulators a unit holds of dK and dV (half the head dim), of its warpgroup's
            // half of dQ's columns (a quarter).
            cfg.head_dim / 2,
            cfg.head_dim / 4,
            map(q, WarpgroupBackwardConfig::BLOCK_Q),
            map(k, cfg.block_k()),
            map(v, cfg.block_k()),
            map(d_out, WarpgroupBackwardConfig::BLOCK_Q),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            d_k.clone().into_tensor_arg(),
            d_v.clone().into_tensor_arg(),
            match d_q_accum {
                Some(accum) => ComptimeOptionArgs::Some(accum.clone().into_tensor_arg()),
                None => ComptimeOptionArgs::None,
            },
            seq_q as u32,
            (heads / kv_heads) as u32,
            params.scale * core::f32::consts::LOG2_E,
            params.scale,
            diagonal_bound(params, seq_q, seq_k),
            cfg,
            q.dtype,
        )
    }
}

/// dK and dV of one block of `cfg.block_k()` keys of one (batch, key/value head), and with
/// `cfg.atomic_dq` `dS·K` of every query block that sees them added to `d_q_accum` (four f32 a
/// vector): `q_map`, `d_out_map`
/// are tensor maps of `[b, h, sq, d]` (boxes of 64 rows × 64 columns), `k_map`, `v_map` of
/// `[b, hkv, sk, d]` (boxes of `cfg.block_k()` rows); `scale` is the softmax scale times
/// log2 e, `grad_scale` the softmax scale. Key `j` is visible to query `i` where `j < seq_k`
/// and, with `cfg.causal`, `j <= i + bound`. `A` is the vector of a unit's dK or dV
/// accumulators (`d / 2`), `Q` of its dQ accumulators (its warpgroup's half of the columns:
/// `d / 4`).
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn warpgroup_key_value_grads<E: Float, A: Size, Q: Size>(
    q_map: &TensorMap<E, Tiled>,
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    d_out_map: &TensorMap<E, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
    mut d_q_accum: ComptimeOption<&mut Tensor<Atomic<Vector<f32, Const<4>>>>>,
    seq_q: u32,
    group: u32,
    scale: f32,
    grad_scale: f32,
    bound: i32,
    #[comptime] cfg: WarpgroupBackwardConfig,
    #[define(E)] _dtype: ElemType,
) {
    let units = comptime!(cfg.units() as u32);
    let block_q = comptime!(WarpgroupBackwardConfig::BLOCK_Q);
    let block_k = comptime!(cfg.block_k());
    let d = comptime!(cfg.head_dim);
    let (batch, kv_head) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let key_start = CUBE_POS_X as usize * block_k;
    let seq_q = seq_q as usize;
    let seq_k = d_k.shape(2);
    let group = group as usize;
    let (first_block, blocks) = query_blocks(key_start, seq_q, bound, cfg);
    let steps = blocks * group;

    let mut keys = Shared::<[E]>::new_aligned_slice(comptime!(block_k * d), 1024usize);
    let mut values = Shared::<[E]>::new_aligned_slice(comptime!(block_k * d), 1024usize);
    let stages_len = comptime!(WarpgroupBackwardConfig::STAGES * block_q * d);
    let mut queries = Shared::<[E]>::new_aligned_slice(stages_len, 1024usize);
    let mut d_outs = Shared::<[E]>::new_aligned_slice(stages_len, 1024usize);
    // `dSᵀ` of the owned keys, two buffers: the A operand of the atomic dQ's products, a
    // block's written while the block before it may still be read.
    let mut scores_grad =
        Shared::<[E]>::new_aligned_slice(comptime!(cfg.scores_grad_elems()), 1024usize);
    // A stage is full when the copy engine has written it (the first unit's arrival, with the
    // bytes it expects), empty when every unit is done with it.
    let owned_full = Barrier::shared(1, UNIT_POS == 0);
    let full = (
        Barrier::shared(1, UNIT_POS == 0),
        Barrier::shared(1, UNIT_POS == 0),
        Barrier::shared(1, UNIT_POS == 0),
    );
    let empty = (
        Barrier::shared(units, UNIT_POS == 0),
        Barrier::shared(units, UNIT_POS == 0),
        Barrier::shared(units, UNIT_POS == 0),
    );
    // The copy engine completes on the barriers: their initialisation must be visible to it.
    sync_async_proxy_shared();
    sync_cube();

    let step_at = StepAt {
        batch,
        first_head: kv_head * group,
        first_block,
        blocks,
    };
    if UNIT_POS == 0 {
        owned_full.arrive_and_expect_tx(1, comptime!((2 * block_k * d * 2) as u32));
        load_panels::<E>(
            &owned_full,
            k_map,
            &mut keys,
            0,
            batch,
            kv_head,
            key_start,
            block_k,
            d,
        );
        load_panels::<E>(
            &owned_full,
            v_map,
            &mut values,
            0,
            batch,
            kv_head,
            key_start,
            block_k,
            d,
        );
        #[unroll]
        for stage in 0..comptime!(WarpgroupBackwardConfig::STAGES) {
            if stage < steps {
                fetch_step::<E>(
                    &full,
                    q_map,
                    d_out_map,
                    &mut queries,
                    &mut d_outs,
                    stage,
                    &step_at,
                    stage,
                    cfg,
                );
            }
        }
    }

    let unit = UNIT_POS as usize % 128;
    let warpgroup = UNIT_POS as usize / 128;
    // The warpgroup's first key, and this unit's first row (`16 w + lane / 4`, and 8 below).
    let rows_start = key_start + warpgroup * 64;
    let key_row = rows_start + position(unit, 0usize).0;
    // Descriptors in 16-byte units: the warpgroup's 64 rows of the owned panels (64 rows of
    // 128 bytes further each), the first stage's queries and output gradients read both ways.
    let own_rows = comptime!((64 * 128 / 16) as u64) * warpgroup as u64;
    let keys_desc = descriptor::<E>(&keys) + own_rows;
    let values_desc = descriptor::<E>(&values) + own_rows;
    // dQ's product reads every owned key, from this warpgroup's half of the columns on: the
    // second panel at head dim 128, 64 bytes into each row at 64.
    let half_columns = comptime!(cfg.head_dim / 2) * warpgroup;
    let keys_across = descriptor_across_rows::<E>(&keys, comptime!((block_k * 128) as u64))
        + ((half_columns / 64 * comptime!(block_k * 128 / 16) + half_columns % 64 * 2 / 16) as u64);
    let queries_desc = descriptor::<E>(&queries);
    let d_outs_desc = descriptor::<E>(&d_outs);
    let stage_panel = comptime!((block_q * 128) as u64);
    let queries_across = descriptor_across_rows::<E>(&queries, stage_panel);
    let d_outs_across = descriptor_across_rows::<E>(&d_outs, stage_panel);
    let scores_grad_across =
        descriptor_across_rows::<E>(&scores_grad, comptime!((64 * 128) as u64));
    let buffer_units = comptime!((block_k * 64 * 2 / 16) as u64);
    let stage_units = comptime!((block_q * d * 2 / 16) as u64);
    let crosses_end = rows_start + 64 > seq_k;

    let mut d_k_acc = Vector::<f32, A>::new(0.0);
    let mut d_v_acc = Vector::<f32, A>::new(0.0);
    // The statistics of the block a step walks are loaded a step ahead: their loads' latency
    // passes under a whole step's products instead of the block's first two.
    // (A cube with no step reads none: its statistics may be an empty tensor.)
    let mut next_lse = Stats::new(0.0);
    let mut next_delta = Stats::new(0.0);
    if steps > 0 {
        let (first_head, first_start) = step_at.at(0usize);
        let (lse_ahead, delta_ahead) =
            load_stats(lse, delta, batch, first_head, first_start, seq_q);
        next_lse = lse_ahead;
        next_delta = delta_ahead;
    }
    owned_full.wait_parity(0);
    for step in 0..steps {
        let stage = step % comptime!(WarpgroupBackwardConfig::STAGES);
        let use_ = step / comptime!(WarpgroupBackwardConfig::STAGES);
        wait_stage(&full, stage, use_ as u32 % 2);
        let (head, q_start) = step_at.at(step);
        let (row_lse, row_delta) = (next_lse, next_delta);
        let offset = stage_units * stage as u64;
        let s = product::<Const<32>>(
            keys_desc,
            queries_desc + offset,
            block_k,
            block_q,
            d,
            cfg.bf16,
        );
        let dp = product::<Const<32>>(
            values_desc,
            d_outs_desc + offset,
            block_k,
            block_q,
            d,
            cfg.bf16,
        );
        // The last step loads its own block's again: in cache, and never read.
        let (next_head, next_start) = step_at.at(min(step + 1, steps - 1));
        let (lse_ahead, delta_ahead) = load_stats(lse, delta, batch, next_head, next_start, seq_q);
        wait_products();
        // Only the blocks that cross the keys' end or a diagonal test each score.
        let hidden = crosses_end
            || (comptime!(cfg.causal) && (rows_start + 63) as i32 > q_start as i32 + bound);
        let p = probabilities(
            &s, &row_lse, q_start, key_row, seq_k, scale, bound, hidden, cfg,
        );
        let ds = score_grads(&p, &dp, &row_delta);
        // `row_lse` and `row_delta` name the carried registers themselves (a cube binding
        // copies nothing): they take the next step's only after their last read.
        next_lse = lse_ahead;
        next_delta = delta_ahead;
        d_v_acc = product_pv::<A, Const<16>>(
            d_v_acc,
            fragment::<E>(&p),
            d_outs_across + offset,
            block_q,
            d,
            cfg.bf16,
        );
        d_k_acc = product_pv::<A, Const<16>>(
            d_k_acc,
            fragment::<E>(&ds),
            queries_across + offset,
            block_q,
            d,
            cfg.bf16,
        );
        if comptime!(cfg.atomic_dq) {
            // `dSᵀ` through the async proxy to both warpgroups' dQ products; its buffer was last
            // read two blocks before, which both warpgroups waited on before the last barrier.
            let buffer = step % 2;
            store_transposed::<E>(
                &ds,
                &mut scores_grad,
                buffer * block_k * 64 + warpgroup * 64 * 64,
            );
            sync_async_proxy_shared();
            sync_consumers(units);
            let dq = product_across_rows::<Q>(
                scores_grad_across + buffer_units * buffer as u64,
                keys_across,
                comptime!(cfg.head_dim / 2),
                block_k,
                cfg.bf16,
            );
            wait_products();
            release_stage(&empty, stage);
            add_query_grads::<Q>(
                &dq,
                &mut d_q_accum,
                batch,
                head,
                q_start,
                seq_q,
                half_columns,
                d,
            );
        } else {
            // The stage's Q and dO are read by the products alone.
            wait_products();
            release_stage(&empty, stage);
        }
        // The first unit refills the stage of the block before this one once every unit
        // released it: a block's copies run while the one before it computes.
        if UNIT_POS == 0 && step >= 1 {
            let next = step - 1 + comptime!(WarpgroupBackwardConfig::STAGES);
            if next < steps {
                let last = step - 1;
                let released = last % comptime!(WarpgroupBackwardConfig::STAGES);
                let use_ = last / comptime!(WarpgroupBackwardConfig::STAGES);
                wait_stage(&empty, released, use_ as u32 % 2);
                fetch_step::<E>(
                    &full,
                    q_map,
                    d_out_map,
                    &mut queries,
                    &mut d_outs,
                    released,
                    &step_at,
                    next,
                    cfg,
                );
            }
        }
    }

    write_rows::<E, A>(&d_k_acc, d_k, batch, kv_head, key_row, seq_k, grad_scale);
    write_rows::<E, A>(&d_v_acc, d_v, batch, kv_head, key_row, seq_k, 1.0);
}

/// Where step `n` of a cube's walk is: the query blocks of each query head of the group in
/// turn, from the first that sees the cube's keys.
#[derive(CubeType)]
struct StepAt {
    batch: usize,
    first_head: usize,
    first_block: usize,
    blocks: usize,
}

#[cube]
impl StepAt {
    /// The query head and first query row of step `n`.
    fn at(&self, n: usize) -> (usize, usize) {
        let head = self.first_head + n / self.blocks;
        let block = self.first_block + n % self.blocks;
        (head, block * comptime!(WarpgroupBackwardConfig::BLOCK_Q))
    }
}

/// The first query block that sees keys from `key_start` on and how many do from it: all of
/// them, or causal, those from the one holding the first key's diagonal (none where that lies
/// past the last query).
#[cube]
fn query_blocks(
    key_start: usize,
    seq_q: usize,
    bound: i32,
    #[comptime] cfg: WarpgroupBackwardConfig,
) -> (usize, usize) {
    let all = seq_q.div_ceil(comptime!(WarpgroupBackwardConfig::BLOCK_Q));
    if comptime!(cfg.causal) {
        // Query `i` sees key `j` where `i >= j - bound`.
        let first_query = key_start as i32 - bound;
        let first = if first_query <= 0 {
            0usize
        } else {
            min(
                all,
                first_query as usize / comptime!(WarpgroupBackwardConfig::BLOCK_Q),
            )
        };
        (first, all - first)
    } else {
        (0usize, all)
    }
}

/// Issue step `n`'s query block and its output gradients into stage `stage`, completing on
/// `barrier` (the arrival with the bytes it expects first). Rows past the sequence arrive as
/// zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_step<E: Float>(
    full: &Ring,
    q_map: &TensorMap<E, Tiled>,
    d_out_map: &TensorMap<E, Tiled>,
    queries: &mut Shared<[E]>,
    d_outs: &mut Shared<[E]>,
    stage: usize,
    step_at: &StepAt,
    n: usize,
    #[comptime] cfg: WarpgroupBackwardConfig,
) {
    let block_q = comptime!(WarpgroupBackwardConfig::BLOCK_Q);
    let stage_len = comptime!(block_q * cfg.head_dim);
    let (head, row) = step_at.at(n);
    let start = stage * stage_len;
    if stage == 0 {
        fetch_rows::<E>(
            &full.0,
            q_map,
            d_out_map,
            queries,
            d_outs,
            start,
            step_at.batch,
            head,
            row,
            cfg,
        );
    } else if stage == 1 {
        fetch_rows::<E>(
            &full.1,
            q_map,
            d_out_map,
            queries,
            d_outs,
            start,
            step_at.batch,
            head,
            row,
            cfg,
        );
    } else {
        fetch_rows::<E>(
            &full.2,
            q_map,
            d_out_map,
            queries,
            d_outs,
            start,
            step_at.batch,
            head,
            row,
            cfg,
        );
    }
}

/// Issue the 64 rows from `row` of (batch, head) of Q and dO into the stages from `start`,
/// completing on `barrier` (the arrival with the bytes it expects first).
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_rows<E: Float>(
    barrier: &Barrier,
    q_map: &TensorMap<E, Tiled>,
    d_out_map: &TensorMap<E, Tiled>,
    queries: &mut Shared<[E]>,
    d_outs: &mut Shared<[E]>,
    start: usize,
    batch: usize,
    head: usize,
    row: usize,
    #[comptime] cfg: WarpgroupBackwardConfig,
) {
    let block_q = comptime!(WarpgroupBackwardConfig::BLOCK_Q);
    barrier.arrive_and_expect_tx(1, comptime!((2 * block_q * cfg.head_dim * 2) as u32));
    load_panels::<E>(
        barrier,
        q_map,
        queries,
        start,
        batch,
        head,
        row,
        block_q,
        cfg.head_dim,
    );
    load_panels::<E>(
        barrier,
        d_out_map,
        d_outs,
        start,
        batch,
        head,
        row,
        block_q,
        cfg.head_dim,
    );
}

/// Wait for phase `parity` of stage `stage`'s barrier of `ring`.
#[cube]
fn wait_stage(ring: &Ring, stage: usize, parity: u32) {
    if stage == 0 {
        ring.0.wait_parity(parity);
    } else if stage == 1 {
        ring.1.wait_parity(parity);
    } else {
        ring.2.wait_parity(parity);
    }
}

/// Arrive on stage `stage`'s barrier of `ring`.
#[cube]
fn release_stage(ring: &Ring, stage: usize) {
    if stage == 0 {
        ring.0.arrive();
    } else if stage == 1 {
        ring.1.arrive();
    } else {
        ring.2.arrive();
    }
}

/// The forward's log-sum-exp (times log2 e) and `D` of the 16 queries whose columns this unit
/// holds in a block from `q_start` of (batch, head), as [`score_grads`] reads them: column
/// `c` is `c / 2 * 8 + c % 2` right of the unit's first. Queries past `seq_q` read 0: their rows
/// of Q and dO are zeros, so are their terms.
#[cube]
fn load_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    batch: usize,
    head: usize,
    q_start: usize,
    seq_q: usize,
) -> (Stats, Stats) {
    let lane = UNIT_POS as usize % 32;
    let base = batch * lse.stride(0) + head * lse.stride(1);
    let first = q_start + (lane % 4) * 2;
    let mut row_lse = Stats::empty();
    let mut row_delta = Stats::empty();
    #[unroll]
    for column in 0..16usize {
        let query = first + comptime!(column / 2 * 8 + column % 2);
        let inside = query < seq_q;
        let at = base + select(inside, query, 0usize);
        row_lse.insert(
            column,
            select(inside, lse[at] * core::f32::consts::LOG2_E, 0.0f32),
        );
        row_delta.insert(column, select(inside, delta[at], 0.0f32));
    }
    (row_lse, row_delta)
}

/// `Pᵀ` of one block from the raw scores `s` (keys × queries): `P = 2^(s · scale − lse ·
/// log2 e)` with the forward's log-sum-exp ([`load_stats`]), 0 where `hidden` blocks hide the
/// pair (a key past `seq_k` or, causal, right of the query's diagonal).
#[cube]
#[allow(clippy::too_many_arguments)]
fn probabilities(
    s: &Tile,
    row_lse: &Stats,
    q_start: usize,
    key_row: usize,
    seq_k: usize,
    scale: f32,
    bound: i32,
    hidden: bool,
    #[comptime] cfg: WarpgroupBackwardConfig,
) -> Tile {
    let lane = UNIT_POS as usize % 32;
    let mut p = Tile::empty();
    // Accumulator `nth` is row `nth % 4 / 2 * 8` below the unit's first, column
    // `nth / 4 * 8 + nth % 2` right of its first ([`position`]): statistic `nth / 4 * 2 + nth % 2`.
    #[unroll]
    for nth in 0..32usize {
        let column = comptime!(nth / 4 * 2 + nth % 2);
        let query = q_start + comptime!(nth / 4 * 8 + nth % 2) + (lane % 4) * 2;
        let key = key_row + comptime!(nth % 4 / 2 * 8);
        let mut prob = exp2(
            s.extract(nth) * scale - row_lse.extract(column),
            TilePath::TensorCore,
        );
        if hidden {
            let mut visible = key < seq_k;
            if comptime!(cfg.causal) {
                visible = visible && key as i32 <= query as i32 + bound;
            }
            prob = select(visible, prob, 0.0f32);
        }
        p.insert(nth, prob);
    }
    p
}

/// `dSᵀ = Pᵀ ∘ (dPᵀ − D)` of one block, `D` per query column as [`load_stats`] reads it.
#[cube]
fn score_grads(p: &Tile, dp: &Tile, row_delta: &Stats) -> Tile {
    let mut ds = Tile::empty();
    #[unroll]
    for nth in 0..32usize {
        let column = comptime!(nth / 4 * 2 + nth % 2);
        ds.insert(
            nth,
            p.extract(nth) * (dp.extract(nth) - row_delta.extract(column)),
        );
    }
    ds
}

/// A tile's accumulators as the A registers of a product over its columns: accumulators `2f`
/// and `2f + 1` (same row, adjacent columns) are register `f`, as
/// [`fragment_position`](crate::kernel::tile::wgmma::fragment_position) places them.
#[cube]
fn fragment<E: Float>(tile: &Tile) -> Fragment {
    let mut registers = Fragment::empty();
    #[unroll]
    for f in 0..16usize {
        let mut pair = Vector::<E, Const<2>>::empty();
        pair.insert(0usize, E::cast_from(tile.extract(comptime!(2 * f))));
        pair.insert(1usize, E::cast_from(tile.extract(comptime!(2 * f + 1))));
        registers.insert(f, u32::reinterpret(pair));
    }
    registers
}

/// `dSᵀ` (keys × queries) into the warpgroup's 64 rows of `tile` from `base`, [`swizzled`]:
/// the layout the dQ product reads across its rows.
#[cube]
fn store_transposed<E: Float>(ds: &Tile, tile: &mut Shared<[E]>, base: usize) {
    let unit = UNIT_POS as usize % 128;
    #[unroll]
    for nth in 0..32usize {
        let (row, col) = position(unit, nth);
        tile[base + swizzled(row, col)] = E::cast_from(ds.extract(nth));
    }
}

/// Wait until the cube's `units` arrive, on a named barrier (the cube's own, 0, waits for
/// every unit of a cube).
#[cube]
fn sync_consumers(#[comptime] units: u32) {
    let body = comptime!(format!("bar.sync 1, {units};"));
    gpu_asm!("{body}");
}

/// Add the unit's `dS·K` accumulators (64 query rows × `d / 2` columns from `first_column`, at
/// [`position`]) to the query rows from `q_start` of (batch, head) in `d_q_accum` (`d`
/// columns; nothing without one), four columns an atomic add, rows past `seq_q` left. A unit holds two adjacent
/// columns of each 8; the pair of units `2t`, `2t + 1` swap one pair per two groups of 8, so
/// that each holds four adjacent columns of one of them.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_query_grads<Q: Size>(
    dq: &Vector<f32, Q>,
    d_q_accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, Const<4>>>>>,
    batch: usize,
    head: usize,
    q_start: usize,
    seq_q: usize,
    first_column: usize,
    #[comptime] d: usize,
) {
    #[comptime]
    if let ComptimeOption::Some(accum) = d_q_accum {
        let unit = UNIT_POS as usize % 128;
        let odd = unit % 2 == 1;
        let base = (batch * accum.shape(1) + head) * seq_q;
        #[unroll]
        for half in 0..2usize {
            let query = q_start + position(unit, comptime!(half * 2)).0;
            #[unroll]
            for pair in 0..comptime!(d / 32) {
                // Groups of 8 columns `2 pair` and `2 pair + 1`: accumulators `g * 4 + half * 2 + c`.
                let first = comptime!(pair * 8 + half * 2);
                let second = comptime!(pair * 8 + 4 + half * 2);
                let send0 = select(odd, dq.extract(first), dq.extract(second));
                let send1 = select(
                    odd,
                    dq.extract(comptime!(first + 1)),
                    dq.extract(comptime!(second + 1)),
                );
                let got0 = plane_shuffle_xor(send0, 1);
                let got1 = plane_shuffle_xor(send1, 1);
                let mut sum = Vector::<f32, Const<4>>::empty();
                sum.insert(0usize, select(odd, got0, dq.extract(first)));
                sum.insert(1usize, select(odd, got1, dq.extract(comptime!(first + 1))));
                sum.insert(2usize, select(odd, dq.extract(second), got0));
                sum.insert(3usize, select(odd, dq.extract(comptime!(second + 1)), got1));
                // Even units add group `2 pair`'s columns `2t..2t + 4`, odd ones group
                // `2 pair + 1`'s from `2t - 2`.
                let column = first_column
                    + comptime!(pair * 16)
                    + select(odd, 8usize + (unit % 4 - 1) * 2, (unit % 4) * 2);
                if query < seq_q {
                    accum[((base + query) * d + column) / 4].fetch_add(sum);
                }
            }
        }
    }
}

/// The unit's accumulators of dK or dV (its two rows from `key_row`, at [`position`]) times
/// `factor` into the rows below `seq_k` of (batch, key/value head) of `grads`.
#[cube]
fn write_rows<E: Float, A: Size>(
    acc: &Vector<f32, A>,
    grads: &mut Tensor<E>,
    batch: usize,
    kv_head: usize,
    key_row: usize,
    seq_k: usize,
    factor: f32,
) {
    let unit = UNIT_POS as usize % 128;
    let base = batch * grads.stride(0) + kv_head * grads.stride(1);
    let row_stride = grads.stride(2);
    #[unroll]
    for nth in 0..A::value() {
        let (_, col) = position(unit, nth);
        let key = key_row + comptime!((nth % 4) / 2 * 8);
        if key < seq_k {
            grads[base + key * row_stride + col] = E::cast_from(acc.extract(nth) * factor);
        }
    }
}
