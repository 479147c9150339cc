//! The backward's fused kernels as [`backward`](fn@crate::kernel::backward) would enqueue
//! them, created without a client ([`sources`](crate::kernel::sources)).

use cubecl::prelude::*;

use super::key_value::key_value_grads;
use super::launch::{key_value_parts, partials_shape, tail_split, walk_dims};
use super::plan::{BackwardPlan, BackwardProblem};
use super::query::query_grads;
use crate::kernel::config::{TailPart, TilePath};
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::{cube_count, cube_dim};
use crate::kernel::sources::base::{Placeholder, PlannedKernel, Problem, Target};
use crate::kernel::tensors::{F32, ScoreInputs, stage_map_of};
use crate::kernel::tile::{MmaTile, PortableTile};

/// The backward of `problem` on `target` (its dQ as `problem.options.deterministic` asks): the
/// dK/dV launch, each part where its plan splits the last wave, then dQ's own launch unless the
/// plan adds dQ by atomics, with the arguments [`backward`](fn@crate::kernel::backward) passes.
/// `Err` where the plan refuses the problem.
pub fn backward(target: &Target, problem: &Problem) -> Result<Vec<PlannedKernel>, String> {
    let Problem {
        dtype,
        batch,
        heads,
        seq,
        head_dim,
        ..
    } = *problem;
    let inputs = ScoreInputs::new(None, None);
    let params = problem
        .params()
        .with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let rows = [batch, heads, seq, head_dim];
    let [q, k, v, d_out, d_q, d_k, d_v] = [(); 7].map(|()| Placeholder::new(rows, dtype));
    let [lse, delta] = [(); 2].map(|()| Placeholder::new([batch, heads, seq], F32));
    let plan = BackwardPlan::new(
        &DeviceCaps::from_properties(&target.device, dtype),
        &BackwardProblem {
            dtype,
            batch,
            heads,
            kv_heads: heads,
            seq_q: seq,
            seq_k: seq,
            head_dim,
            value_dim: head_dim,
            params,
            bias_batch: None,
            deterministic: problem.options.deterministic,
            bias_grad: false,
            staged_tma_aligned: q.tma_aligned() && d_out.tma_aligned(),
            kv_tma_aligned: k.tma_aligned() && v.tma_aligned(),
            varlen: false,
        },
    )?;
    let BackwardPlan {
        key_value: cfg,
        query: query_cfg,
        dq_width,
        tail,
        ..
    } = plan;
    let accum = cfg.atomic_dq.then(|| Placeholder::new(rows, F32));
    // The Hopper backward in place of the dK/dV launch (the dQ launch after it where dQ is not
    // its atomics').
    #[cfg(feature = "cuda")]
    let warpgroup_kernel = plan.warpgroup.map(|warpgroup| {
        use super::warpgroup::warpgroup_key_value_grads;
        use crate::kernel::config::WarpgroupBackwardConfig;
        use crate::kernel::forward::warpgroup::tensor_map;
        let rows_of = WarpgroupBackwardConfig::BLOCK_Q;
        let [q_map, d_out_map] = [&q, &d_out].map(|t| tensor_map(t.arg(), dtype, rows_of));
        let [k_map, v_map] = [&k, &v].map(|t| tensor_map(t.arg(), dtype, warpgroup.block_k()));
        let count = CubeCount::Static(
            seq.div_ceil(warpgroup.block_k()) as u32,
            heads as u32,
            batch as u32,
        );
        let dim = CubeDim::new_1d(warpgroup.units() as u32);
        PlannedKernel::of(
            "warpgroup_key_value_grads",
            &plan,
            &warpgroup,
            count.clone(),
            dim,
            warpgroup_key_value_grads::create_dummy_kernel(
                target.device.clone(),
                target.target.clone(),
                count,
                dim,
                head_dim / 2,
                head_dim / 4,
                q_map,
                k_map,
                v_map,
                d_out_map,
                lse.arg(),
                delta.arg(),
                d_k.arg(),
                d_v.arg(),
                accum.as_ref().map(Placeholder::arg).into(),
                seq as u32,
                1,
                params.scale,
                params.scale,
                0,
                warpgroup,
                dtype,
            ),
        )
    });
    #[cfg(not(feature = "cuda"))]
    let warpgroup_kernel: Option<PlannedKernel> = None;
    let partials = tail.map(|plan| Placeholder::new(partials_shape(&cfg, plan), F32));
    let key_blocks = seq.div_ceil(cfg.block_q);
    let grid_rows = if cfg.batch_inner { batch } else { heads };
    let address = Placeholder::address_type(&[&q, &k, &v, &d_out, &d_q, &d_k, &d_v]);
    let dtypes = [dtype, inputs.mask_dtype()];
    let softcap = params.softcap.unwrap_or(1.0);
    let (seed_lo, seed_hi, threshold) = params.dropout_args();
    let alibi_pow2 = params.alibi_pow2.unwrap_or(1);

    macro_rules! planned {
        ($tile:ty) => {{
            let mut kernels: Vec<_> = warpgroup_kernel.into_iter().collect();
            let key_value_parts = if kernels.is_empty() {
                key_value_parts(&cfg, tail, seq, heads, batch)
            } else {
                Vec::new()
            };
            for (grid, part_cfg) in key_value_parts {
                let part_partials = partials
                    .as_ref()
                    .filter(|_| part_cfg.tail == TailPart::Pieces);
                kernels.push(PlannedKernel::new(
                    "key_value_grads",
                    &plan,
                    &part_cfg,
                    grid.clone(),
                    cube_dim(&cfg),
                    key_value_grads::create_dummy_kernel::<$tile>(
                        target.device.clone(),
                        target.target.clone(),
                        grid,
                        cube_dim(&cfg),
                        address,
                        dq_width,
                        q.arg(),
                        k.arg(),
                        v.arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.arg(),
                        stage_map_of(|| q.arg(), dtype, &cfg).into(),
                        stage_map_of(|| d_out.arg(), dtype, &cfg).into(),
                        lse.arg(),
                        delta.arg(),
                        d_k.arg(),
                        d_v.arg(),
                        accum.as_ref().map(Placeholder::arg).into(),
                        part_partials.map(Placeholder::arg).into(),
                        ComptimeOptionArgs::None,
                        walk_dims(&q.meta, &k.meta, &q.meta, &d_out.meta, &lse.meta),
                        tail_split(tail, key_blocks, grid_rows),
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        part_cfg,
                        dtypes,
                    ),
                ));
            }
            if !cfg.atomic_dq && seq > 0 {
                let grid = cube_count(&query_cfg, seq, heads, batch, 1);
                kernels.push(PlannedKernel::new(
                    "query_grads",
                    &plan,
                    &query_cfg,
                    grid.clone(),
                    cube_dim(&query_cfg),
                    query_grads::create_dummy_kernel::<$tile>(
                        target.device.clone(),
                        target.target.clone(),
                        grid,
                        cube_dim(&query_cfg),
                        address,
                        q.arg(),
                        k.arg(),
                        v.arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.arg(),
                        lse.arg(),
                        delta.arg(),
                        d_q.arg(),
                        ComptimeOptionArgs::None,
                        ComptimeOptionArgs::None,
                        walk_dims(&q.meta, &k.meta, &k.meta, &v.meta, &lse.meta),
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        query_cfg,
                        dtypes,
                    ),
                ));
            }
            kernels
        }};
    }
    Ok(match cfg.tile {
        TilePath::TensorCore => planned!(MmaTile),
        TilePath::Portable => planned!(PortableTile),
    })
}
