//! Masking: which keys a query block sees. Causal attention is aligned bottom-right, as Burn's
//! fallback: key `j` is visible to query `i` iff `j <= i + seq_k - seq_q`. Only blocks that cross
//! the diagonal or the end of the keys are masked element by element; blocks wholly above the
//! diagonal are never visited.

use cubecl::prelude::*;

use super::config::TileConfig;
use super::tile::AttentionTile;

/// Number of KV blocks the query block starting at `q_start` must visit.
#[cube]
pub fn kv_blocks(q_start: usize, seq_q: usize, seq_k: usize, #[comptime] cfg: TileConfig) -> usize {
    let q_end = min(q_start + cfg.block_q, seq_q);
    visible_key_end(q_end, seq_q, seq_k, cfg.causal).div_ceil(cfg.block_kv)
}

/// Whether some pair of the `q_rows` queries from `q_start` and the `kv_rows` keys from
/// `kv_start` is hidden or out of range: only such blocks are masked element by element.
#[cube]
pub fn block_needs_mask(
    q_start: usize,
    #[comptime] q_rows: usize,
    kv_start: usize,
    #[comptime] kv_rows: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] causal: bool,
) -> bool {
    let kv_end = kv_start + kv_rows;
    let mut needs = kv_end > seq_k || q_start + q_rows > seq_q;
    if comptime!(causal) {
        // The block's first query sees keys j < q_start + 1 + seq_k - seq_q.
        needs = needs || kv_end + seq_q > q_start + 1 + seq_k;
    }
    needs
}

/// Set the scores of hidden keys to `-inf`.
#[cube]
pub fn apply_mask<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    q_start: usize,
    kv_start: usize,
    seq_q: usize,
    seq_k: usize,
    neg_inf: f32,
    #[comptime] cfg: TileConfig,
) {
    #[unroll]
    for reg in 0..cfg.score_regs() {
        let (row, col) = T::score_position(reg, cfg);
        let key = kv_start + col;
        let mut hidden = key >= seq_k;
        if comptime!(cfg.causal) {
            hidden = hidden || key + seq_q > q_start + row + seq_k;
        }
        scores[reg] = select(hidden, neg_inf, scores[reg]);
    }
}

/// Whether query `query` sees key `key` (absolute rows), out-of-range rows seeing nothing.
#[cube]
pub fn key_visible(
    query: usize,
    key: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] causal: bool,
) -> bool {
    let mut visible = query < seq_q && key < seq_k;
    if comptime!(causal) {
        visible = visible && key + seq_q <= query + seq_k;
    }
    visible
}

/// End (exclusive) of the keys that queries `[.., q_end)` can see.
#[cube]
pub fn visible_key_end(
    q_end: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut end = seq_k;
    if comptime!(causal) {
        let reach = q_end + seq_k;
        end = min(select(reach > seq_q, reach - seq_q, 0usize), seq_k);
    }
    end
}

/// First query that can see key `key` (`seq_q` when none can).
#[cube]
pub fn first_seeing_query(
    key: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut first = 0usize;
    if comptime!(causal) {
        // Query i sees key j iff i >= j + seq_q - seq_k.
        let reach = key + seq_q;
        first = min(select(reach > seq_k, reach - seq_k, 0usize), seq_q);
    }
    first
}
