//! The contract between the algorithm and a matrix tile: [`AttentionTile`].

use cubecl::prelude::*;

use crate::kernel::config::TileConfig;

/// One unit's share of a query block: its query rows, its score registers for one KV block
/// (`cfg.score_regs()` of them) and its output accumulators (`cfg.out_regs()`), with the
/// positions each register stands for. Score register `r` belongs to the unit's row
/// `cfg.score_slot(r)`, output register `r` to `cfg.out_slot(r)`.
#[cube]
pub trait AttentionTile<E: Float>: 'static + Send + Sync {
    /// The query rows this unit multiplies with, in the form the score product consumes.
    type Query: CubeType;
    /// What [`add_staged`](Self::add_staged) multiplies a staged input by.
    type StagedFactor: CubeType;

    /// Load this unit's query rows of the block starting at `q_start` (rows `row_stride` apart
    /// from `head_base`); rows at or past `seq_q` read as zeros.
    fn load_query(
        q: &Tensor<E>,
        head_base: usize,
        row_stride: usize,
        q_start: usize,
        seq_q: usize,
        #[comptime] cfg: TileConfig,
    ) -> Self::Query;

    /// [`load_query`](Self::load_query) of two operands of the same owned rows (keys and
    /// values, or queries and output gradients; `second_cfg` gives the second's width), their
    /// copies in flight together.
    #[allow(clippy::too_many_arguments)]
    fn load_query_pair(
        first: &Tensor<E>,
        first_base: usize,
        second: &Tensor<E>,
        second_base: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
        #[comptime] second_cfg: TileConfig,
    ) -> (Self::Query, Self::Query);

    /// Raw scores S = Q·Kᵀ of this unit's registers for the K block staged at `stage_base`.
    fn scores(
        query: &Self::Query,
        keys: &Shared<[E]>,
        stage_base: usize,
        #[comptime] cfg: TileConfig,
    ) -> Array<f32>;

    /// Add the raw scores Q·Kᵀ that [`scores`](Self::scores) returns to the registers
    /// `scores` (`cfg.score_regs()` of them) instead of starting from zeros.
    fn add_scores(
        query: &Self::Query,
        keys: &Shared<[E]>,
        stage_base: usize,
        scores: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    );

    /// O += P·V for the V block staged at `stage_base`, P being this unit's score registers.
    fn accumulate(
        probs: &Array<f32>,
        values: &Shared<[E]>,
        stage_base: usize,
        out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    );

    /// Both backward products of planes that split their group's staged block (`cfg.split > 1`,
    /// tensor-core dK/dV launch): `second_out += Pᵀ·second` and `first_out += Gᵀ·first` over
    /// the whole block, `probs` and `grads` being this unit's score registers of `P` and `G`
    /// (its part of the block's columns). Each plane's parts go through `exchange`
    /// ([`TileConfig::exchange_slots`] blocks of `cfg.block_q · cfg.block_kv`), and each plane
    /// adds its part of the accumulator columns (`cfg` for `second`, `key_cfg` for `first`). The
    /// caller synchronises the cube before `exchange` is written again.
    #[allow(clippy::too_many_arguments)]
    fn accumulate_split(
        probs: &Array<f32>,
        grads: &Array<f32>,
        exchange: &mut Shared<[E]>,
        second: &Shared<[E]>,
        second_base: usize,
        second_out: &mut Array<f32>,
        first: &Shared<[E]>,
        first_base: usize,
        first_out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
        #[comptime] key_cfg: TileConfig,
    );

    /// Add `Gᵀ · owned` to the staged rows' gradient in `accum` with f32 atomic adds (dQ from a
    /// cube that owns keys). `grads` are this unit's registers of `G` (owned rows × staged rows,
    /// laid out as [`scores`](Self::scores) leaves them), `owned` the owned rows as
    /// [`load_query`](Self::load_query) gave them (`cfg.head_dim` wide). Staged row `r` adds into
    /// row `staged_start + r` of `accum` from element `accum_base`; rows at or past `staged_len`
    /// are skipped. With split planes (`cfg.split > 1`) `scratch` already holds all of `G`, as
    /// [`accumulate_split`](Self::accumulate_split) left it, and `grads` is not read.
    /// `accum` is read as vectors of `N` f32 (the tensor-core tile adds 4 adjacent columns per
    /// atomic where the runtime adds `float4`, else 1; the portable tile 1).
    /// `scratch` holds `cfg.scratch_elems()` elements; the caller synchronises the cube
    /// before `scratch` is written again. `staging` (`cfg.dq_stage_elems()` f32) is the tile's
    /// own: the tensor-core tile turns its accumulators into whole rows there.
    #[allow(clippy::too_many_arguments)]
    fn add_transposed_product<N: Size>(
        grads: &Array<f32>,
        owned: &Self::Query,
        scratch: &mut Shared<[E]>,
        staging: &mut Shared<[f32]>,
        accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
        accum_base: usize,
        staged_start: usize,
        staged_len: usize,
        #[comptime] cfg: TileConfig,
    );

    /// Write `factor` times this unit's accumulators `regs` (laid out as
    /// [`accumulate`](Self::accumulate) leaves them, `cfg.value_dim` wide) to rows `start + r` of
    /// one head of `out` (from element `head_base`, `row_stride` apart), skipping rows at or past
    /// `seq`. `owned` is the operand this cube owns (as [`load_query`](Self::load_query) gave
    /// it for these rows; its rows at least `cfg.value_dim` wide) and is consumed: the
    /// tensor-core tile stages the block in its shared memory and writes whole 16-byte row
    /// chunks, where storing from the accumulator layout would issue one 2-byte store per
    /// register; the portable tile stores its row directly.
    #[allow(clippy::too_many_arguments)]
    fn store_owned(
        owned: &mut Self::Query,
        regs: &Array<f32>,
        factor: f32,
        out: &mut Tensor<E>,
        head_base: usize,
        row_stride: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
    );

    /// [`add_staged`](Self::add_staged)'s factor, prepared once per launch.
    fn staged_factor(factor: f32, #[comptime] cfg: TileConfig) -> Self::StagedFactor;

    /// Add `factor` ([`staged_factor`](Self::staged_factor)) times a block of a 16-bit score
    /// input staged in shared memory at `base`
    /// ([`input_offset`](crate::kernel::stage::input_offset)) to the score registers.
    fn add_staged(
        scores: &mut Array<f32>,
        stage: &Shared<[E]>,
        base: usize,
        factor: &Self::StagedFactor,
        #[comptime] cfg: TileConfig,
    );

    /// (query row within the block, key column within the KV block) of score register `reg`.
    fn score_position(#[comptime] reg: usize, #[comptime] cfg: TileConfig) -> (usize, usize);

    /// (query row within the block, value column) of output register `reg`.
    fn out_position(#[comptime] reg: usize, #[comptime] cfg: TileConfig) -> (usize, usize);

    /// Query row within the block of the unit's row `slot`.
    fn slot_row(#[comptime] slot: usize, #[comptime] cfg: TileConfig) -> usize;

    /// Whether this unit writes the per-row statistics (one unit per row does).
    fn writes_row_stats() -> bool;

    /// Maximum over the units sharing this unit's row.
    fn row_max(value: f32) -> f32;

    /// Sum over the units sharing this unit's row.
    fn row_sum(value: f32) -> f32;

    /// Whether `flag` holds for any unit that must take the same branch as this one (its plane
    /// on the tensor-core tile, where a divergent branch would split the MMAs).
    fn any_unit(flag: bool) -> bool;
}

/// Score registers of `cfg`, zeroed.
#[cube]
pub fn zero_scores(#[comptime] cfg: TileConfig) -> Array<f32> {
    let mut scores = Array::<f32>::new(cfg.score_regs());
    #[unroll]
    for reg in 0..cfg.score_regs() {
        scores[reg] = 0.0;
    }
    scores
}
