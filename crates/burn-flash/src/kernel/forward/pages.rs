//! Where the forward reads a block of keys and values: in its sequence's own rows, or, in a
//! paged cache, in the page its block table maps the block to. K and V are then
//! `[pages, kv_heads, page_size, dim]` (rows of a head in a page one stride apart), the table
//! `[batch, pages per sequence]`, and a page holds whole blocks (its size a multiple of the
//! block's keys), so that a block never straddles two pages.

use cubecl::prelude::*;

use super::layout::{Layout, PageDims};

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
pub fn key_capacity<I: Int>(block_table: ComptimeOption<&Tensor<I>>, layout: Layout) -> usize {
    let mut rows = layout.key_rows;
    #[comptime]
    if let ComptimeOption::Some(_) = block_table {
        rows = layout.pages.per_sequence * layout.pages.rows;
    }
    rows
}

/// Where the keys `[kv_start, kv_start + block)` of sequence `batch` lie: in a paged cache the
/// page its block table maps them to, else `batch`, the sequence's own rows. A block the
/// sequence does not reach (`kv_start ≥ seq_k`) stands on page 0 and is never read; its entry
/// is loaded all the same (clamped into the sequence's row), so that the load waits for
/// nothing but its address. A page number outside the cache is clamped into it (a negative one
/// to page 0): a bad table reads wrong keys, never outside the tensors.
#[cube]
pub fn block_page<I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    pages: PageDims,
    batch: usize,
    kv_start: usize,
    seq_k: usize,
) -> usize {
    let mut page = batch;
    #[comptime]
    if let ComptimeOption::Some(table) = block_table {
        let column = min(kv_start / pages.rows, max(pages.per_sequence, 1) - 1);
        let listed = max(table[batch * pages.per_sequence + column], I::new(0));
        let listed = min(usize::cast_from(listed), pages.count - 1);
        page = select(kv_start < seq_k, listed, 0usize);
    }
    page
}

/// The rows of keys `[kv_start, kv_start + block)` of key/value head `kv_head` in `page`
/// ([`block_page`]), over a sequence of `seq_k` keys: with a block table, the page's rows;
/// else the sequence's own, whose head's rows start at `k_base` and `v_base`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn block_rows<I: Int>(
    block_table: ComptimeOption<&Tensor<I>>,
    layout: Layout,
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
        let first = kv_start % layout.pages.rows;
        rows.k_base = page * layout.k.outer + kv_head * layout.k.head;
        rows.v_base = page * layout.v.outer + kv_head * layout.v.head;
        rows.first = first;
        rows.end = first + (seq_k - min(kv_start, seq_k));
    }
    rows
}
