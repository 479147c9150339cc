//! The backward on the portable tile against the f64 reference gradients, with dQ from its own
//! launch and from the dK/dV launch's f32 atomics.

use super::{Case, Inputs, PackedBatch, Rng, assert_close, client};
use crate::kernel::{
    KernelTensor, ScoreParams, backward, backward_packed, forward, forward_packed,
};
use crate::{AttentionWindow, FlashAttentionOptions};

/// Gradients of `case` on fresh inputs drawn from `seed`, through the saved output and
/// log-sum-exp of the fused forward, checked against the reference; with `atomic`, dQ is
/// summed by the dK/dV launch's atomics.
fn check(case: &Case, seed: u64, atomic: bool) {
    let client = client();
    let inputs = Inputs::draw(case, seed);
    let d_out = Rng::new(seed + 1).normals(case.out_dims().iter().product());
    let params = ScoreParams::new(
        &case.options,
        case.heads,
        case.head_dim,
        case.seq_q,
        case.seq_k,
    );
    let (q, k, v, scores) = inputs.upload(&client, case);
    let (out, lse) = forward(
        q.clone(),
        k.clone(),
        v.clone(),
        scores.clone(),
        None,
        params,
    );
    let d_out_tensor = KernelTensor::from_f32(&client, &d_out, case.out_dims());

    let _atomic = atomic.then(crate::testing::force_atomic_dq);
    let (atomic_before, _) = crate::testing::dq_launches();
    let grads = backward(
        q,
        k,
        v,
        scores,
        out,
        lse,
        d_out_tensor,
        params,
        !atomic,
        false,
    );
    if atomic {
        assert!(
            crate::testing::dq_launches().0 > atomic_before,
            "{case:?}: the atomic dQ did not run"
        );
    }
    let [dq, dk, dv] = inputs.grads(case, &d_out);
    let label = |name: &str| format!("{case:?} atomic {atomic} {name}");
    assert_close(&label("dQ"), &grads.q.read::<f32>(), &dq, 5e-5);
    assert_close(&label("dK"), &grads.k.read::<f32>(), &dk, 5e-5);
    assert_close(&label("dV"), &grads.v.read::<f32>(), &dv, 5e-5);
    assert!(grads.bias.is_none());
}

/// Plain attention, lengths that are not whole blocks on either side, different value dims.
#[test]
fn plain_gradients_match_the_reference() {
    let cases = [
        Case::new(1, 1, 1, 1, 32),
        Case::new(2, 2, 33, 19, 64),
        Case::new(1, 1, 20, 45, 32).value_dim(16),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 1000 + seed as u64, false);
    }
}

/// Causal and windowed bands, rows that see no key (zero gradients), grouped-query heads
/// whose key/value gradients sum over their group.
#[test]
fn banded_and_grouped_gradients_match_the_reference() {
    let cases = [
        Case::new(1, 2, 40, 40, 64).causal(),
        Case::new(1, 1, 37, 21, 32).causal(),
        Case::new(2, 4, 26, 33, 32).kv_heads(2).causal(),
        Case::new(1, 2, 44, 44, 32).options(
            FlashAttentionOptions::new().with_window(AttentionWindow::new(Some(6), Some(2))),
        ),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 1100 + seed as u64, false);
    }
}

/// Boolean masks (per pair, per key) and a bias: the gradients of q, k and v through them.
#[test]
fn masked_gradients_match_the_reference() {
    let cases = [
        Case::new(2, 2, 30, 34, 32).mask([2, 2, 30, 34]),
        Case::new(1, 2, 25, 40, 64).causal().mask([1, 1, 1, 40]),
        Case::new(2, 1, 24, 31, 32).bias([1, 1, 24, 31]),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 1200 + seed as u64, false);
    }
}

/// FlashAttention-2's atomic dQ, forced on the portable tile (where dQ's own launch is
/// otherwise faster), plain, causal and masked.
#[test]
fn atomic_dq_matches_the_reference() {
    let cases = [
        Case::new(1, 2, 33, 47, 32),
        Case::new(2, 2, 40, 40, 64).causal(),
        Case::new(1, 4, 29, 29, 32).kv_heads(2).mask([1, 4, 29, 29]),
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 1300 + seed as u64, true);
    }
}

/// Sequences of different lengths packed along the rows: each sequence's gradients against its
/// own reference (lengths 0, 1, within a block and over several; more keys than queries and
/// fewer, keys without queries and queries without keys; grouped heads, a value dim of its
/// own, causal and a window), so that a gradient that leaks into a neighbour's rows shows.
#[test]
fn packed_gradients_match_the_reference() {
    let cases = [
        (
            vec![(37, 37), (0, 0), (1, 1), (100, 100), (64, 64)],
            Case::new(1, 4, 0, 0, 32).kv_heads(2).causal(),
        ),
        (
            vec![(5, 90), (0, 7), (3, 0), (70, 33), (1, 1)],
            Case::new(1, 2, 0, 0, 32).kv_heads(1).value_dim(16),
        ),
        (
            vec![(40, 90), (33, 33), (9, 60)],
            Case::new(1, 2, 0, 0, 32).options(
                FlashAttentionOptions::causal().with_window(AttentionWindow::new(Some(20), None)),
            ),
        ),
    ];
    let client = client();
    for (n, (lengths, shape)) in cases.iter().enumerate() {
        let batch = PackedBatch::draw(lengths, shape, 1400 + 10 * n as u64);
        let (h, hkv, d, dv) = (shape.heads, shape.kv_heads, shape.head_dim, shape.value_dim);
        let (q, k, v, packed) = batch.upload(&client);
        let params = batch.params();
        let (out, lse) = forward_packed(q.clone(), k.clone(), v.clone(), packed.clone(), params);
        let d_outs: Vec<Vec<f32>> = batch
            .sequences
            .iter()
            .enumerate()
            .map(|(s, (case, _))| {
                Rng::new(1500 + 10 * n as u64 + s as u64).normals(case.out_dims().iter().product())
            })
            .collect();
        let parts: Vec<&[f32]> = d_outs.iter().map(Vec::as_slice).collect();
        let d_out = PackedBatch::upload_rows(
            &client,
            &batch.pack(&parts, |c| c.seq_q, h, dv),
            batch.total_q(),
            h,
            dv,
        );
        let grads = backward_packed(q, k, v, out, lse, d_out, packed, params);
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        for ((case, inputs), d_out) in batch.sequences.iter().zip(&d_outs) {
            let [dq, dk, dv] = inputs.grads(case, d_out);
            dqs.push(dq);
            dks.push(dk);
            dvs.push(dv);
        }
        assert_eq!(grads.k.meta.shape()[..], [1, hkv, batch.total_k(), d]);
        let label = |name: &str| format!("packed {lengths:?} {shape:?} {name}");
        let expected_q = batch.by_head(&dqs, |c| c.seq_q, h, d);
        assert_close(&label("dQ"), &grads.q.read::<f32>(), &expected_q, 5e-5);
        let expected_k = batch.by_head(&dks, |c| c.seq_k, hkv, d);
        assert_close(&label("dK"), &grads.k.read::<f32>(), &expected_k, 5e-5);
        let expected_v = batch.by_head(&dvs, |c| c.seq_k, hkv, dv);
        assert_close(&label("dV"), &grads.v.read::<f32>(), &expected_v, 5e-5);
    }
}
