//! Where the forward reads a block of keys and values: in its sequence's own rows, or, in a
//! paged cache, in the page its block table maps the block to. K and V are then
//! `[pages, kv_heads, page_size, dim]` (rows of a head in a page one stride apart), the table
//! `[batch, pages per sequence]`, and a page holds whole blocks (its size a multiple of the
//! block's keys), so that a block never straddles two pages.

use cubecl::prelude::*;

/// The rows of keys and values one block is read from.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct BlockRows {
    /// The index of `k`'s and `v`'s first dim they lie in: the sequence's, or its page's (a
    /// tensor map's coordinate).
    pub outer: usize,
    /// Where the head's rows start in `k`.
    pub k_base: usize,
    /// Where the head's rows start in `v`.
    pub v_base: usize,
    /// The block's first row there.
    pub first: usize,
    /// The row at which the sequence ends there: rows from it on are zero-filled.
    pub end: usize,
}

#[cube]
impl BlockRows {
    /// These rows in a packed tensor whose sequence's keys start at row `row`.
    pub fn shifted(self, row: usize) -> BlockRows {
        let mut rows = self;
        rows.first += row;
        rows.end += row;
        rows
    }
}

/// Keys each sequence can hold: `k`'s rows, or with a block table its pages' rows.
#[cube]
pub fn key_capacity<E: Float, I: Int>(
    k: &Tensor<E>,
    block_table: ComptimeOption<&Tensor<I>>,
) -> usize {
    let mut rows = k.shape(2);
    #[comptime]
    if let ComptimeOption::Some(table) = block_table {
        rows = table.shape(1) * k.shape(2);
    }
    rows
}

/// Where the keys `[kv_start, kv_start + block)` of sequence `batch` lie: in a paged cache the
/// page its block table maps them to, else `batch`, the sequence's own rows. Only a block the
/// sequence reaches (`kv_start < seq_k`) reads the table; the others stand on page 0, and are
/// never read. A page number outside the cache is clamped into it (a negative one to page 0):
/// a bad table reads wrong keys, never outside the tensors.
#[cube]
pub fn block_page<E: Float, I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    k: &Tensor<E>,
    batch: usize,
    kv_start: usize,
    seq_k: usize,
) -> usize {
    let mut page = batch;
    #[comptime]
    if let ComptimeOption::Some(table) = block_table {
        page = 0;
        if kv_start < seq_k {
            let entry = batch * table.stride(0) + (kv_start / k.shape(2)) * table.stride(1);
            page = min(
                usize::cast_from(max(table[entry], I::new(0))),
                k.shape(0) - 1,
            );
        }
    }
    page
}

/// The rows of keys `[kv_start, kv_start + block)` of key/value head `kv_head` in `page`
/// ([`block_page`]), over a sequence of `seq_k` keys: with a block table, the page's rows;
/// else the sequence's own, whose head's rows start at `k_base` and `v_base`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn block_rows<E: Float, I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    page: usize,
    kv_head: usize,
    k_base: usize,
    v_base: usize,
    kv_start: usize,
    seq_k: usize,
) -> BlockRows {
    let mut rows = BlockRows {
        outer: page,
        k_base,
        v_base,
        first: kv_start,
        end: seq_k,
    };
    #[comptime]
    if let ComptimeOption::Some(_) = block_table {
        let first = kv_start % k.shape(2);
        rows.k_base = page * k.stride(0) + kv_head * k.stride(1);
        rows.v_base = page * v.stride(0) + kv_head * v.stride(1);
        rows.first = first;
        rows.end = first + (seq_k - min(kv_start, seq_k));
    }
    rows
}
