//! The forward on the portable tile against the f64 reference.

use super::PackedBatch;
use super::{Case, Inputs, assert_close, client};
use crate::kernel::forward::launch::packed_group;
use crate::kernel::tensors::F32;
use crate::kernel::{ScoreInputs, ScoreParams, TilePath, forward, forward_packed, support};
use crate::{AttentionWindow, CausalAlignment, FlashAttentionOptions};

/// The kernel parameters of `case`'s options.
fn params_of(case: &Case) -> ScoreParams {
    ScoreParams::new(
        &case.options,
        case.heads,
        case.head_dim,
        case.seq_q,
        case.seq_k,
    )
}

/// Output and log-sum-exp of `case` on fresh inputs drawn from `seed`, checked.
fn check(case: &Case, seed: u64) {
    check_split(case, seed, 1);
}

/// [`check`] with each row block's keys split across `splits` cubes.
fn check_split(case: &Case, seed: u64, splits: usize) {
    check_with(case, seed, |params| params.with_kv_splits(splits));
}

/// [`check`] with the parameters `adjust` makes of the case's.
fn check_with(case: &Case, seed: u64, adjust: impl Fn(ScoreParams) -> ScoreParams) {
    let client = client();
    let inputs = Inputs::draw(case, seed);
    let (q, k, v, scores) = inputs.upload(&client, case);
    let params = adjust(params_of(case));
    let (k, v, cached) = inputs.cached_keys(&client, case, k, v);
    let (out, lse) = forward(q, k, v, scores, cached, params);
    assert_eq!(out.meta.shape()[..], case.out_dims());
    let (expected_out, expected_lse) = inputs.forward(case);
    assert_close(
        &format!("{case:?} output"),
        &out.read::<f32>(),
        &expected_out,
        2e-5,
    );
    assert_close(
        &format!("{case:?} lse"),
        &lse.read::<f32>(),
        &expected_lse,
        2e-5,
    );
}

#[test]
fn the_portable_tile_runs_f32_on_wgpu() {
    let client = client();
    assert_eq!(support(&client, F32, 64, 64), Ok(TilePath::Portable));
    assert!(support(&client, F32, 300, 64).is_err());
}

/// Lengths one, lengths that are not whole blocks, more keys than queries and fewer, head dims
/// from 8 to 128 and different value dims.
#[test]
fn plain_attention_matches_the_reference() {
    let cases = [
        Case::new(1, 1, 1, 1, 64),
        Case::new(1, 2, 7, 7, 32),
        Case::new(2, 1, 65, 33, 64),
        Case::new(1, 2, 33, 70, 128),
        Case::new(1, 1, 40, 17, 8).value_dim(24),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, seed as u64);
    }
}

/// Causal bottom-right: with fewer keys than queries the first rows see no key (output 0,
/// log-sum-exp `-inf`); a sliding window on both sides.
#[test]
fn causal_and_windowed_attention_match_the_reference() {
    let cases = [
        Case::new(1, 2, 50, 50, 64).causal(),
        Case::new(2, 1, 45, 20, 32).causal(),
        Case::new(1, 1, 20, 61, 64).causal(),
        Case::new(1, 2, 48, 48, 32).options(
            FlashAttentionOptions::new().with_window(AttentionWindow::new(Some(5), Some(3))),
        ),
        Case::new(1, 1, 37, 52, 64).options(
            FlashAttentionOptions::causal().with_window(AttentionWindow::new(Some(9), None)),
        ),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 100 + seed as u64);
    }
}

/// Grouped-query attention reads each key/value head for `heads / kv_heads` query heads.
#[test]
fn grouped_query_attention_matches_the_reference() {
    check(&Case::new(2, 4, 33, 40, 64).kv_heads(2), 200);
    check(&Case::new(1, 6, 17, 29, 32).kv_heads(1).causal(), 201);
}

/// Decoding against a cache: one new query per sequence, or a chunk of three (causal
/// bottom-right: the new queries are the cache's last positions), four or eight query heads to a
/// key/value head, over caches from one key to more than a tile walks in one block.
#[test]
fn decoding_rows_match_the_reference() {
    let cases = [
        Case::new(2, 8, 1, 1, 64).kv_heads(2).causal(),
        Case::new(2, 8, 1, 300, 64).kv_heads(2).causal(),
        Case::new(1, 8, 3, 1000, 64)
            .kv_heads(2)
            .causal()
            .value_dim(32),
        Case::new(3, 8, 1, 77, 32).kv_heads(1).causal(),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 400 + seed as u64);
    }
}

/// Keys split across cubes and merged by their log-sum-exps: decoding rows, several row blocks,
/// causal rows that see no key, windows, masks and biases, more splits than key blocks (empty
/// splits), split counts that are not powers of two, value rows of any width.
#[test]
fn split_keys_match_the_reference() {
    let cases = [
        (Case::new(2, 8, 1, 300, 64).kv_heads(2).causal(), 3),
        (
            Case::new(1, 8, 3, 1000, 64)
                .kv_heads(2)
                .causal()
                .value_dim(32),
            4,
        ),
        (Case::new(1, 2, 70, 45, 32).causal(), 2),
        (Case::new(1, 1, 9, 20, 32), 7),
        // More splits than one merge cube has units: its lanes load the splits in rounds.
        (Case::new(1, 2, 1, 700, 32).causal(), 37),
        // Rows narrower than a merge plane's lanes (the columns past them masked).
        (Case::new(1, 2, 1, 300, 40).kv_heads(1).value_dim(24), 5),
        (
            Case::new(1, 2, 37, 130, 64).options(
                FlashAttentionOptions::causal().with_window(AttentionWindow::new(Some(40), None)),
            ),
            3,
        ),
        (
            Case::new(2, 2, 5, 90, 32)
                .mask([2, 1, 1, 90])
                .bias([1, 2, 5, 90]),
            2,
        ),
    ];
    for (seed, (case, splits)) in cases.iter().enumerate() {
        check_split(case, 500 + seed as u64, *splits);
    }
}

/// One query per sequence with the query heads of a key/value head packed into one block's
/// rows, alone and with split keys; where something depends on the row (a window, top-left
/// causal) the packing steps aside. (This module's reference aligns bottom-right only; the
/// suite's tests top-left.)
#[test]
fn packed_groups_match_the_reference() {
    // (case, splits, packed)
    let cases = [
        (Case::new(2, 8, 1, 300, 64).kv_heads(2).causal(), 1, true),
        (
            Case::new(1, 8, 1, 1000, 64).kv_heads(1).value_dim(32),
            4,
            true,
        ),
        (Case::new(3, 6, 1, 77, 32).kv_heads(3).causal(), 2, true),
        (
            Case::new(1, 4, 1, 90, 32).kv_heads(2).options(
                FlashAttentionOptions::causal().with_window(AttentionWindow::new(Some(20), None)),
            ),
            1,
            false,
        ),
        // One row of keys per sequence (a cache's lengths): every packed row reads it alike.
        (
            Case::new(2, 8, 1, 150, 32)
                .kv_heads(2)
                .causal()
                .mask([2, 1, 1, 150]),
            2,
            true,
        ),
        // A mask per head does not pack.
        (
            Case::new(1, 4, 1, 70, 32).kv_heads(2).mask([1, 4, 1, 70]),
            1,
            false,
        ),
    ];
    for (seed, (case, splits, packed)) in cases.iter().enumerate() {
        let seed = 600 + seed as u64;
        let adjust = |params: ScoreParams| params.with_pack_groups(true).with_kv_splits(*splits);
        let params = adjust(params_of(case));
        let (_, _, _, scores) = Inputs::draw(case, seed).upload(&client(), case);
        let group = packed_group(case.heads, case.kv_heads, case.seq_q, &scores, &params);
        assert_eq!(group.is_some(), *packed, "{case:?}");
        check_with(case, seed, adjust);
    }
    // Top-left, one query sees key 0 only: the rows would need diagonals of their own.
    let top_left = FlashAttentionOptions::causal().with_causal_alignment(CausalAlignment::TopLeft);
    let params = ScoreParams::new(&top_left, 4, 32, 1, 50);
    assert_eq!(
        packed_group(4, 2, 1, &ScoreInputs::new(None, None), &params),
        None
    );
}

/// Boolean masks per pair and per key (broadcast over queries, heads or batches), and additive
/// biases, alone and with the causal mask.
#[test]
fn masks_and_biases_match_the_reference() {
    let cases = [
        Case::new(2, 2, 33, 45, 64).mask([2, 2, 33, 45]),
        Case::new(2, 2, 30, 41, 32).mask([2, 1, 1, 41]),
        Case::new(1, 2, 40, 40, 64).causal().mask([1, 2, 40, 40]),
        Case::new(2, 2, 21, 35, 32).bias([1, 2, 21, 35]),
        Case::new(1, 2, 36, 36, 64)
            .causal()
            .mask([1, 1, 36, 36])
            .bias([1, 2, 36, 36]),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 300 + seed as u64);
    }
}

/// Each sequence its own number of keys (a cache filled to different lengths), read from the
/// device: lengths 0 (output 0, log-sum-exp `-inf`), 1, within a block, a whole block and past
/// the keys' rows (counted as all of them); causal on each sequence's own diagonal (the first
/// queries of a chunk longer than its sequence see nothing), windows, grouped heads packed into
/// rows, and split keys.
#[test]
fn per_sequence_key_lengths_match_the_reference() {
    let lengths = [0, 1, 37, 64, 90, 500];
    let cases = [
        (Case::new(6, 2, 1, 90, 32).key_lengths(&lengths), 1),
        (
            Case::new(6, 8, 1, 90, 64)
                .kv_heads(2)
                .causal()
                .key_lengths(&lengths),
            1,
        ),
        (
            Case::new(6, 8, 1, 90, 64)
                .kv_heads(2)
                .causal()
                .key_lengths(&lengths),
            3,
        ),
        (
            Case::new(6, 4, 5, 90, 32)
                .kv_heads(1)
                .causal()
                .value_dim(16)
                .key_lengths(&lengths),
            2,
        ),
        (
            Case::new(6, 2, 3, 90, 32)
                .options(
                    FlashAttentionOptions::causal()
                        .with_window(AttentionWindow::new(Some(20), None)),
                )
                .key_lengths(&lengths),
            1,
        ),
        (
            Case::new(2, 2, 70, 130, 32).causal().key_lengths(&[100, 3]),
            1,
        ),
        // i32 lengths, as Burn's integer tensors come, read without a cast: a negative one
        // holds no key.
        (
            Case::new(6, 8, 1, 90, 64)
                .kv_heads(2)
                .causal()
                .key_lengths(&[-5, 0, 1, 64, 90, 500])
                .signed_indices(),
            3,
        ),
    ];
    for (seed, (case, splits)) in cases.iter().enumerate() {
        let adjust = |params: ScoreParams| params.with_pack_groups(true).with_kv_splits(*splits);
        check_with(case, 700 + seed as u64, adjust);
    }
}

/// A paged cache: keys and values in shuffled pages of 16, 32 and 64 rows (one more page than
/// the sequences use, and every row no key fills, NaN), found through a block table; lengths
/// 0, 1, within a page, whole pages and every key; causal one query and chunks, packed groups,
/// split keys, a window.
#[test]
fn paged_keys_match_the_reference() {
    let lengths = [0, 1, 37, 64, 90, 77];
    let cases = [
        (
            Case::new(6, 2, 1, 90, 32).key_lengths(&lengths).pages(16),
            1,
        ),
        (
            Case::new(6, 8, 1, 130, 64)
                .kv_heads(2)
                .causal()
                .key_lengths(&lengths)
                .pages(64),
            3,
        ),
        (
            Case::new(6, 4, 5, 90, 32)
                .kv_heads(1)
                .causal()
                .value_dim(16)
                .key_lengths(&lengths)
                .pages(32),
            2,
        ),
        (
            Case::new(6, 2, 3, 90, 32)
                .options(
                    FlashAttentionOptions::causal()
                        .with_window(AttentionWindow::new(Some(20), None)),
                )
                .key_lengths(&lengths)
                .pages(16),
            1,
        ),
        // An i32 table and lengths.
        (
            Case::new(6, 8, 1, 130, 64)
                .kv_heads(2)
                .causal()
                .key_lengths(&[77, -1, 1, 37, 64, 130])
                .pages(32)
                .signed_indices(),
            2,
        ),
    ];
    for (seed, (case, splits)) in cases.iter().enumerate() {
        let adjust = |params: ScoreParams| params.with_pack_groups(true).with_kv_splits(*splits);
        check_with(case, 800 + seed as u64, adjust);
    }
}

/// Sequences of different lengths packed along the rows (`[total, heads, dim]`), each its own
/// attention problem: lengths 0 and 1, within a block and over several, more keys than queries
/// and fewer (a sequence's first queries then see nothing, causal bottom-right), keys without
/// queries and queries without keys; grouped heads, a value dim of its own, a window, the
/// top-left alignment. Each sequence's reference is computed alone, so a key read from a
/// neighbour shows.
#[test]
fn packed_sequences_match_the_reference() {
    let same = |lengths: &[usize]| lengths.iter().map(|&n| (n, n)).collect::<Vec<_>>();
    let cases: [(Vec<(usize, usize)>, Case); 5] = [
        (same(&[37, 0, 1, 100, 64]), Case::new(1, 2, 0, 0, 32)),
        (
            same(&[37, 0, 1, 100, 64]),
            Case::new(1, 4, 0, 0, 32).kv_heads(2).causal(),
        ),
        (
            vec![(5, 90), (0, 7), (3, 0), (70, 33), (1, 1)],
            Case::new(1, 4, 0, 0, 64).kv_heads(1).causal().value_dim(16),
        ),
        (
            vec![(40, 90), (33, 33), (9, 60)],
            Case::new(1, 2, 0, 0, 32).options(
                FlashAttentionOptions::causal().with_window(AttentionWindow::new(Some(20), None)),
            ),
        ),
        (
            vec![(40, 90), (70, 33), (9, 9)],
            Case::new(1, 2, 0, 0, 32).options(
                FlashAttentionOptions::causal().with_causal_alignment(CausalAlignment::TopLeft),
            ),
        ),
    ];
    let client = client();
    for (n, (lengths, shape)) in cases.iter().enumerate() {
        let batch = PackedBatch::draw(lengths, shape, 900 + 10 * n as u64);
        let (q, k, v, packed) = batch.upload(&client);
        let (out, lse) = forward_packed(q, k, v, packed, batch.params());
        let (h, dv, total_q) = (shape.heads, shape.value_dim, batch.total_q());
        assert_eq!(out.meta.shape()[..], [1, h, total_q, dv]);
        let (mut expected_out, mut expected_lse) = (Vec::new(), Vec::new());
        for (case, inputs) in &batch.sequences {
            let (out, lse) = inputs.forward(case);
            expected_out.push(out);
            expected_lse.push(lse);
        }
        let label = format!("packed {lengths:?} {shape:?}");
        assert_close(
            &format!("{label} output"),
            &out.read::<f32>(),
            &batch.by_head(&expected_out, |c| c.seq_q, h, dv),
            2e-5,
        );
        assert_close(
            &format!("{label} lse"),
            &lse.read::<f32>(),
            &batch.by_head(&expected_lse, |c| c.seq_q, h, 1),
            2e-5,
        );
    }
}
