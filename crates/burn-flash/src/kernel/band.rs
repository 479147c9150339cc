//! The band of visible keys around each query's diagonal: key `i + seq_k - seq_q` for query `i`
//! when aligned bottom-right (Burn's default), key `i` when aligned top-left
//! ([`MaskConfig::top_left`]); [`diagonal`] gives the pair of terms that place it. The causal
//! mask hides keys right of the diagonal by more than `right` (0 when only causal), a sliding
//! window hides keys left of it by more than `left`. Which bounds exist is comptime
//! ([`MaskConfig`]); their offsets are runtime ([`Band`]). All comparisons add to both sides
//! instead of subtracting, so unsigned indices never wrap.

use cubecl::prelude::*;

use super::config::{MaskConfig, TileConfig};

/// Lengths and band offsets of one (batch, head).
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Band {
    pub seq_q: usize,
    pub seq_k: usize,
    /// Keys left of the diagonal that stay visible (sliding window; unused without one).
    pub left: usize,
    /// Keys right of the diagonal that stay visible (0 for causal; unused without the bound).
    pub right: usize,
}

#[cube]
impl Band {
    /// The band of `seq_q` queries over `seq_k` keys with these offsets.
    pub fn new(seq_q: usize, seq_k: usize, left: u32, right: u32) -> Band {
        Band {
            seq_q,
            seq_k,
            left: left as usize,
            right: right as usize,
        }
    }

    /// This band with the keys cut to sequence `batch`'s length in `key_lengths` (`[b]`, how
    /// many leading keys of each sequence exist: a cache's filled part), where given. Lengths
    /// past the keys' rows count as all of them, so no row outside the tensor is read; negative
    /// ones (signed `I`) as none. The bottom-right diagonal moves with the length: a sequence's
    /// last query sits on its last key.
    pub fn of_sequence<I: Int>(
        self,
        key_lengths: ComptimeOption<&Tensor<I>>,
        batch: usize,
    ) -> Band {
        let mut band = self;
        #[comptime]
        if let ComptimeOption::Some(lengths) = key_lengths {
            let length = max(lengths[batch], I::new(0));
            band.seq_k = min(usize::cast_from(length), band.seq_k);
        }
        band
    }

    /// This band cut to packed sequence `batch`, with the rows where its queries and its keys
    /// start: `starts` (`[2, sequences + 1]`) holds the cumulative query lengths in its first
    /// row and the key lengths in its second, so that sequence `b` owns query rows
    /// `starts[0, b]..starts[0, b + 1]` and key rows `starts[1, b]..starts[1, b + 1]`. Without
    /// `starts`, the band as it is and rows from 0. Its diagonals are the sequence's own.
    pub fn of_packed(
        self,
        starts: ComptimeOption<&Tensor<u32>>,
        batch: usize,
    ) -> (Band, usize, usize) {
        let mut band = self;
        let mut q_row = 0usize;
        let mut k_row = 0usize;
        #[comptime]
        if let ComptimeOption::Some(starts) = starts {
            let keys = starts.stride(0);
            q_row = usize::cast_from(starts[batch]);
            k_row = usize::cast_from(starts[keys + batch]);
            band.seq_q = usize::cast_from(starts[batch + 1]) - q_row;
            band.seq_k = usize::cast_from(starts[keys + batch + 1]) - k_row;
        }
        (band, q_row, k_row)
    }
}

/// The diagonal of query `i` is key `i + diag_k - diag_q`: `(seq_q, seq_k)` bottom-right,
/// `(0, 0)` top-left. Compared by adding `diag_q` to the key's side and `diag_k` to the query's.
/// Bottom-right hands back the band's own lengths, no new variable: its kernels stay as they
/// were before the alignment existed.
#[cube]
pub fn diagonal(band: Band, #[comptime] mask: MaskConfig) -> (usize, usize) {
    if comptime!(mask.top_left.0) {
        (usize::new(0), usize::new(0))
    } else {
        (band.seq_q, band.seq_k)
    }
}

/// Whether query `query` sees key `key` (absolute rows); out-of-range rows see nothing.
#[cube]
pub fn key_visible(band: Band, query: usize, key: usize, #[comptime] mask: MaskConfig) -> bool {
    let (diag_q, diag_k) = diagonal(band, mask);
    let mut visible = query < band.seq_q && key < band.seq_k;
    if comptime!(mask.right) {
        visible = visible && key + diag_q <= query + diag_k + band.right;
    }
    if comptime!(mask.left) {
        visible = visible && key + diag_q + band.left >= query + diag_k;
    }
    visible
}

/// The keys `[start, end)` that some query of `[q_start, q_end)` sees (`q_end > q_start`).
#[cube]
pub fn key_range(
    band: Band,
    q_start: usize,
    q_end: usize,
    #[comptime] mask: MaskConfig,
) -> (usize, usize) {
    let (diag_q, diag_k) = diagonal(band, mask);
    let mut start = 0usize;
    let mut end = band.seq_k;
    if comptime!(mask.right) {
        // The last query sees keys j < q_end + diag_k + right - diag_q.
        let reach = q_end + diag_k + band.right;
        end = min(select(reach > diag_q, reach - diag_q, 0usize), end);
    }
    if comptime!(mask.left) {
        // The first query sees keys j >= q_start + diag_k - diag_q - left.
        let reach = q_start + diag_k;
        let floor = diag_q + band.left;
        start = min(select(reach > floor, reach - floor, 0usize), end);
    }
    (start, end)
}

/// The queries `[start, end)` that see some key of `[k_start, k_end)` (`k_end > k_start`).
#[cube]
pub fn query_range(
    band: Band,
    k_start: usize,
    k_end: usize,
    #[comptime] mask: MaskConfig,
) -> (usize, usize) {
    let (diag_q, diag_k) = diagonal(band, mask);
    let mut start = 0usize;
    let mut end = band.seq_q;
    if comptime!(mask.left) {
        // Key j is seen by queries i <= j + diag_q - diag_k + left.
        let reach = k_end + diag_q + band.left;
        end = min(select(reach > diag_k, reach - diag_k, 0usize), end);
    }
    if comptime!(mask.right) {
        // Key j is seen by queries i >= j + diag_q - diag_k - right.
        let reach = k_start + diag_q;
        let floor = diag_k + band.right;
        start = min(select(reach > floor, reach - floor, 0usize), end);
    }
    (start, end)
}

/// Blocks of `cfg.block_kv` keys `[first, end)` the query block starting at `q_start` visits.
#[cube]
pub fn kv_blocks(band: Band, q_start: usize, #[comptime] cfg: TileConfig) -> (usize, usize) {
    let q_end = min(q_start + cfg.block_q, band.seq_q);
    let (start, end) = key_range(band, q_start, q_end, cfg.mask);
    (start / cfg.block_kv, end.div_ceil(cfg.block_kv))
}

/// Whether some pair of the `q_rows` queries from `q_start` and the `kv_rows` keys from
/// `kv_start` is hidden by the band or out of range: only such blocks are masked by the band
/// element by element.
#[cube]
pub fn block_needs_mask(
    band: Band,
    q_start: usize,
    #[comptime] q_rows: usize,
    kv_start: usize,
    #[comptime] kv_rows: usize,
    #[comptime] mask: MaskConfig,
) -> bool {
    let (diag_q, diag_k) = diagonal(band, mask);
    let kv_end = kv_start + kv_rows;
    let q_end = q_start + q_rows;
    let mut needs = kv_end > band.seq_k || q_end > band.seq_q;
    if comptime!(mask.right) {
        // The first query hides keys j >= q_start + 1 + diag_k + right - diag_q.
        needs = needs || kv_end + diag_q > q_start + 1 + diag_k + band.right;
    }
    if comptime!(mask.left) {
        // The last query hides keys j < q_end - 1 + diag_k - diag_q - left.
        needs = needs || kv_start + diag_q + band.left + 1 < q_end + diag_k;
    }
    needs
}
