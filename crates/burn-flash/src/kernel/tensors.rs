//! Host-side tensors of a launch: the score inputs as the kernels read them, the outputs
//! (poisoned for tests), tensor maps of the staged operands, vector and address widths.

use burn::tensor::{BoolStore, DType, Shape};
use burn_cubecl::kernel::{bool_cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::prelude::*;
use cubecl::tensor_vector_size_parallel;

use super::config::{CHUNK, TileConfig};

/// The mask and bias inputs of a launch, contiguous, the mask's booleans as integers.
#[derive(Clone, Debug)]
pub struct ScoreInputs<R: CubeRuntime> {
    /// `[b|1, h|1, sq|1, sk]`, `true` (bit 0 set) hides the pair.
    pub mask: Option<CubeTensor<R>>,
    /// `[b|1, h|1, sq|1, sk]`, in the inputs' dtype.
    pub bias: Option<CubeTensor<R>>,
}

impl<R: CubeRuntime> ScoreInputs<R> {
    /// These inputs as broadcasts ([`broadcast_view`]), made contiguous; a mask stored as native
    /// booleans becomes u8.
    pub fn new(mask: Option<CubeTensor<R>>, bias: Option<CubeTensor<R>>) -> Self {
        let mask = mask.map(broadcast_view).map(|mask| match mask.dtype {
            DType::Bool(BoolStore::Native) => bool_cast(mask, DType::U8),
            _ => mask,
        });
        Self {
            mask,
            bias: bias.map(broadcast_view),
        }
    }

    /// The facts of these inputs the plans decide on.
    pub(crate) fn facts(&self) -> ScoreFacts {
        let facts = |t: &CubeTensor<R>| {
            let dims = t.meta.shape();
            InputFacts {
                elem_size: t.dtype.size(),
                dims: [dims[0], dims[1], dims[2], dims[3]],
            }
        };
        ScoreFacts {
            mask: self.mask.as_ref().map(facts),
            bias: self.bias.as_ref().map(facts),
        }
    }

    /// The mask's dims, if there is one.
    pub(crate) fn mask_dims(&self) -> Option<&[usize]> {
        self.mask.as_ref().map(|mask| &mask.meta.shape()[..])
    }

    /// The integer type the kernels read the mask as (u8 when there is none).
    pub(crate) fn mask_dtype(&self) -> StorageType {
        self.mask
            .as_ref()
            .map_or(DType::U8, |mask| mask.dtype)
            .into()
    }

    /// The address width the kernels need to index the mask and bias.
    pub(crate) fn address_type(&self) -> AddressType {
        address_type(&self.mask.iter().chain(&self.bias).collect::<Vec<_>>())
    }

    pub(crate) fn mask_arg(&self) -> Option<TensorArg<R>> {
        self.mask.clone().map(CubeTensor::into_tensor_arg)
    }

    pub(crate) fn bias_arg(&self) -> Option<TensorArg<R>> {
        self.bias.clone().map(CubeTensor::into_tensor_arg)
    }
}

/// `input` (`[b, h, sq, sk]`) read as the broadcast it is: a batch, head or query dim expanded
/// with stride 0 (as `Tensor::expand` leaves one) gets size 1, which every kernel broadcasts,
/// rather than being copied out to its full size; what is then still not contiguous is copied.
fn broadcast_view<R: CubeRuntime>(mut input: CubeTensor<R>) -> CubeTensor<R> {
    for dim in 0..3 {
        if input.meta.strides()[dim] == 0 {
            input.meta.shape_mut()[dim] = 1;
        }
    }
    // A dim of size 1 is never stepped over: give it the stride a contiguous tensor has, which
    // is what `into_contiguous` checks.
    let mut stride = 1;
    for dim in (0..input.meta.num_dims()).rev() {
        let size = input.meta.shape()[dim];
        if size == 1 {
            input.meta.strides_mut()[dim] = stride;
        }
        stride *= size;
    }
    into_contiguous(input)
}

/// What the plans need to know of one score input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputFacts {
    /// Bytes per element.
    pub elem_size: usize,
    /// Its sizes, `[b|1, h|1, sq|1, sk]`.
    pub dims: [usize; 4],
}

/// What the plans need to know of a launch's score inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScoreFacts {
    pub mask: Option<InputFacts>,
    pub bias: Option<InputFacts>,
}

/// A contiguous output, filled with NaN first when tests asked for poisoned outputs.
pub(crate) fn output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    let tensor =
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype);
    if crate::testing::poison_enabled() && tensor.meta.num_elements() > 0 {
        poison(&tensor);
    }
    tensor
}

/// `value` is a runtime argument: WGSL has no literal for NaN.
#[cube(launch_unchecked, address_type = "dynamic")]
fn fill<F: Float, N: Size>(
    tensor: &mut Tensor<Vector<F, N>>,
    value: f32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < tensor.len() {
        tensor[ABSOLUTE_POS] = Vector::new(F::cast_from(value));
    }
}

fn poison<R: CubeRuntime>(tensor: &CubeTensor<R>) {
    fill_tensor(tensor, f32::NAN);
}

/// The widest vector the client moves in one access that divides the last dim of each of
/// `tensors` and all their other strides (1 when none does).
pub(crate) fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    tensors
        .iter()
        .map(|t| {
            tensor_vector_size_parallel(
                t.client.io_optimized_vector_sizes(t.dtype.size()),
                t.meta.shape(),
                t.meta.strides(),
                t.meta.num_dims() - 1,
            )
        })
        .min()
        .unwrap_or(1)
}

/// The address width every index into `tensors` fits (32 bits unless one is too large).
pub(crate) fn address_type<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// Set every element of a contiguous tensor to `value`, a vector per unit.
pub(crate) fn fill_tensor<R: CubeRuntime>(tensor: &CubeTensor<R>, value: f32) {
    let width = vector_width(&[tensor]);
    let units = tensor.meta.num_elements() / width;
    if units == 0 {
        return;
    }
    let cube_dim = CubeDim::new(&tensor.client, units);
    let cube_count = cubecl::calculate_cube_count_elemwise(&tensor.client, units, cube_dim);
    // SAFETY: one unit per vector, guarded by the tensor length (in vectors).
    unsafe {
        fill::launch_unchecked(
            &tensor.client,
            cube_count,
            cube_dim,
            tensor.required_address_type(),
            width,
            tensor.clone().into_tensor_arg(),
            value,
            tensor.dtype.into(),
        );
    }
}

/// With `cfg.tma`, a tensor map of `t` (`[b, h, seq, cfg.head_dim]`) whose box is one stage's
/// rows (`cfg.block_kv`) by 64 columns, one 128-byte line each, with the 128-byte swizzle the
/// stages are read with: one box per stage at head dim 64, one per panel of 64 columns wider
/// ([`TileConfig::staged_pitch`]).
pub(crate) fn stage_map<R: CubeRuntime>(
    t: &CubeTensor<R>,
    cfg: &TileConfig,
) -> Option<TensorMapArg<R, Tiled>> {
    cfg.tma.then(|| {
        let tile = Shape::new([1, 1, cfg.block_kv, 8 * CHUNK]);
        let elem: StorageType = t.dtype.into();
        TensorMapArg::new(TiledArgs::new(tile), t.clone().into_tensor_arg(), elem)
            .with_swizzle(TensorMapSwizzle::B128)
    })
}

/// Whether `t` can be read through a tensor map: its start and every stride but the unit one
/// are whole 16-byte units.
pub(crate) fn tma_aligned<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    let size = t.dtype.size();
    let strides = t.meta.strides();
    t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
        && strides[strides.len() - 1] == 1
        && strides
            .iter()
            .all(|s| (s * size).is_multiple_of(16) || *s == 1)
}

#[cfg(test)]
mod tests {
    //! On the bare wgpu backend (lavapipe in CI).
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use burn_cubecl::CubeBackend;

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    /// Expanded views keep their storage: a stride-0 dim becomes a broadcast dim, the values
    /// read through it are those of the expanded tensor, and other views are copied.
    #[test]
    fn score_inputs_read_expanded_views_as_broadcasts() {
        let device = WgpuDevice::default();
        let source = Tensor::<B, 4>::random([1, 2, 1, 5], Distribution::Uniform(0.0, 1.0), &device);
        let expanded = source.clone().expand([3, 2, 4, 5]);
        let mask = source
            .clone()
            .lower_elem(0.5)
            .expand([3, 2, 4, 5])
            .into_primitive();
        let bias = expanded.clone().into_primitive().tensor();
        let storage = format!("{:?}", bias.handle.memory);
        let inputs = super::ScoreInputs::new(Some(mask), Some(bias));

        let bias = inputs.bias.unwrap();
        assert_eq!(bias.meta.shape()[..], [1, 2, 1, 5]);
        assert_eq!(format!("{:?}", bias.handle.memory), storage, "copied");
        let read = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(bias));
        assert_eq!(read.expand([3, 2, 4, 5]).to_data(), expanded.to_data());
        let mask = inputs.mask.unwrap();
        assert_eq!(mask.meta.shape()[..], [1, 2, 1, 5]);
        assert!(mask.is_contiguous());

        // A transposed view has no stride 0: copied, dims kept.
        let transposed = source.expand([3, 2, 4, 5]).swap_dims(2, 3);
        let bias =
            super::ScoreInputs::new(None, Some(transposed.clone().into_primitive().tensor()))
                .bias
                .unwrap();
        assert!(bias.is_contiguous());
        assert_eq!(bias.meta.shape()[..], [1, 2, 5, 4]);
    }
}
