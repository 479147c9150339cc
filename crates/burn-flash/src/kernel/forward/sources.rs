//! The forward's kernel as [`forward`](fn@crate::kernel::forward) would enqueue it, created
//! without a client ([`sources`](crate::kernel::sources)).

use cubecl::prelude::*;

use super::kernel::flash_forward;
use super::layout::placeholder;
use super::plan::{ForwardPlan, ForwardProblem};
use crate::kernel::config::TilePath;
#[cfg(feature = "cuda")]
use crate::kernel::config::WarpgroupConfig;
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::{cube_count, cube_dim};
use crate::kernel::sources::base::{Placeholder, PlannedKernel, Problem, Target};
use crate::kernel::tensors::{F32, ScoreInputs, U32, stage_map_of};
use crate::kernel::tile::{MmaTile, PortableTile};

/// The forward of `problem` on `target`: the kernel its plan picks, with the arguments
/// [`forward`](fn@crate::kernel::forward) passes. `Err` where the plan refuses the problem.
pub fn forward(target: &Target, problem: &Problem) -> Result<Vec<PlannedKernel>, String> {
    let Problem {
        dtype,
        batch,
        heads,
        seq,
        head_dim,
        ..
    } = *problem;
    let inputs = ScoreInputs::new(None, None);
    // The kernel over whole rows of keys: a split's partial outputs would need other shapes.
    let params = problem
        .params()
        .with_inputs(inputs.mask_dims(), inputs.bias.is_some())
        .with_kv_splits(1);
    let rows = [batch, heads, seq, head_dim];
    let [q, k, v, out] = [(); 4].map(|()| Placeholder::new(rows, dtype));
    let lse = Placeholder::new([batch, heads, seq], F32);
    let plan = ForwardPlan::new(
        &DeviceCaps::from_properties(&target.device, dtype),
        &ForwardProblem {
            dtype,
            batch,
            heads,
            seq_q: seq,
            seq_k: seq,
            head_dim,
            value_dim: head_dim,
            params,
            inputs: inputs.facts(),
            key_lengths: false,
            page_size: None,
            varlen: false,
            kv_tma_aligned: k.tma_aligned() && v.tma_aligned(),
        },
    )?;
    let (seed_lo, seed_hi, threshold) = params.dropout_args();
    #[cfg(feature = "cuda")]
    if let Some(warpgroup) = plan.warpgroup {
        use super::warpgroup::{cube_count, cube_dim, tensor_map, warpgroup_forward};
        let q_map = tensor_map(q.arg(), dtype, warpgroup.block_q());
        let [k_map, v_map] =
            [&k, &v].map(|t| tensor_map(t.arg(), dtype, WarpgroupConfig::BLOCK_KV));
        let (count, dim) = (
            cube_count(
                &warpgroup,
                batch,
                heads,
                seq,
                target
                    .device
                    .hardware
                    .num_streaming_multiprocessors
                    .map(|n| n as usize),
            ),
            cube_dim(&warpgroup),
        );
        return Ok(vec![PlannedKernel::of(
            "warpgroup_forward",
            &plan,
            &warpgroup,
            count.clone(),
            dim,
            warpgroup_forward::create_dummy_kernel(
                target.device.clone(),
                target.target.clone(),
                count,
                dim,
                head_dim / 2,
                q_map,
                k_map,
                v_map,
                out.arg(),
                lse.arg(),
                ComptimeOptionArgs::None,
                ComptimeOptionArgs::None,
                ComptimeOptionArgs::None,
                seq as u32,
                1,
                params.scale,
                0,
                f32::NEG_INFINITY,
                seed_lo,
                seed_hi,
                threshold,
                warpgroup,
                dtype,
            ),
        )]);
    }
    let cfg = plan.cfg;
    let cube_dim = cube_dim(&cfg);
    let cube_count = cube_count(&cfg, seq, heads, batch, 1);
    let address = Placeholder::address_type(&[&q, &k, &v, &out]);
    let dtypes = [dtype, inputs.mask_dtype(), U32];

    macro_rules! planned {
        ($tile:ty) => {
            PlannedKernel::new(
                "flash_forward",
                &plan,
                &cfg,
                cube_count.clone(),
                cube_dim,
                flash_forward::create_dummy_kernel::<$tile>(
                    target.device.clone(),
                    target.target.clone(),
                    cube_count.clone(),
                    cube_dim,
                    address,
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    stage_map_of(|| k.arg(), dtype, &cfg).into(),
                    stage_map_of(|| v.arg(), dtype, &cfg).into(),
                    inputs.mask_arg().into(),
                    ComptimeOptionArgs::None,
                    inputs.bias_arg().into(),
                    ComptimeOptionArgs::None,
                    ComptimeOptionArgs::None,
                    placeholder(),
                    ComptimeOptionArgs::None,
                    out.arg(),
                    lse.arg(),
                    params.scale,
                    params.left,
                    params.right,
                    params.softcap.unwrap_or(1.0),
                    f32::NEG_INFINITY,
                    seed_lo,
                    seed_hi,
                    threshold,
                    params.alibi_pow2.unwrap_or(1),
                    cfg,
                    dtypes,
                ),
            )
        };
    }
    Ok(vec![match cfg.tile {
        TilePath::TensorCore => planned!(MmaTile),
        TilePath::Portable => planned!(PortableTile),
    }])
}
