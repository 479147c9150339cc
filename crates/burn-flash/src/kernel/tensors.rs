//! Host-side tensors of a launch: the tensor type the kernels take, the score inputs as the
//! kernels read them, the outputs (poisoned for tests), tensor maps of the staged operands, vector
//! and address widths.

use cubecl::ir::{ElemType, FloatKind, IntKind, UIntKind};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::std::tensor::{TensorHandle, into_contiguous};
use cubecl::tensor_vector_size_parallel;
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{Shape, Strides};

use super::config::{CHUNK, TileConfig};

/// f32, the dtype of the log-sum-exp, of the row dots and of the atomic dQ's accumulator.
pub const F32: ElemType = ElemType::Float(FloatKind::F32);
/// f16.
pub const F16: ElemType = ElemType::Float(FloatKind::F16);
/// bf16.
pub const BF16: ElemType = ElemType::Float(FloatKind::BF16);
/// u8, the dtype a mask is read as when there is none.
pub const U8: ElemType = ElemType::UInt(UIntKind::U8);
/// u32, the dtype of a packed mask.
pub const U32: ElemType = ElemType::UInt(UIntKind::U32);
/// i32, which key lengths and block tables may be read as beside u32 (Burn's default integer
/// dtype on CUDA and wgpu, read without a cast).
pub const I32: ElemType = ElemType::Int(IntKind::I32);

/// A tensor on a CubeCL device as the kernels take it: the client of its device, its buffer,
/// shape and strides (in elements), and its dtype. Burn's `CubeTensor` has the same fields.
#[derive(Clone)]
pub struct KernelTensor {
    /// The client of the tensor's device.
    pub client: Client,
    /// The buffer holding the elements.
    pub handle: Handle,
    /// Shape and strides.
    pub meta: Box<Metadata>,
    /// The element type.
    pub dtype: ElemType,
}

impl core::fmt::Debug for KernelTensor {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KernelTensor")
            .field("shape", self.meta.shape())
            .field("strides", self.meta.strides())
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl KernelTensor {
    /// A tensor over `handle` with this shape and these strides.
    pub fn new(
        client: Client,
        handle: Handle,
        shape: impl Into<Shape>,
        strides: impl Into<Strides>,
        dtype: ElemType,
    ) -> Self {
        Self {
            client,
            handle,
            meta: Box::new(Metadata::new(shape, strides)),
            dtype,
        }
    }

    /// A new contiguous tensor of this shape (row-major, rows unpadded), its elements not
    /// initialised. Not `TensorHandle::empty`: CubeCL 0.12 pads the rows of that one to a power
    /// of two bytes, up to the device's allocation alignment (512 bytes on CUDA), and the
    /// kernels index their scratch (the atomic dQ's accumulator, the tail's partial sums, the
    /// packed masks) as unpadded rows: at head dim 96 the padded accumulator took dQ's atomics
    /// at the wrong rows.
    pub fn empty(client: &Client, shape: impl Into<Shape>, dtype: ElemType) -> Self {
        let shape: Shape = shape.into();
        // One byte at least: a buffer of none is not allocated everywhere.
        let bytes = (shape.iter().product::<usize>() * dtype.size()).max(1);
        let handle = TensorHandle::new_contiguous(shape, client.empty(bytes), dtype);
        Self::from_handle(client.clone(), handle)
    }

    /// A new tensor of this shape holding `values`, row-major.
    ///
    /// # Panics
    ///
    /// If `values` does not hold one element per position of `shape`.
    pub fn from_values<E: CubeElement + Scalar>(
        client: &Client,
        values: &[E],
        shape: impl Into<Shape>,
    ) -> Self {
        let shape: Shape = shape.into();
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "one value per element"
        );
        let layout =
            client.create_tensor_from_slice(E::as_bytes(values), shape.clone(), size_of::<E>());
        Self::new(
            client.clone(),
            layout.memory,
            shape,
            layout.strides,
            E::elem_type_native(),
        )
    }

    /// A new f32 tensor of this shape holding `values`, row-major.
    pub fn from_f32(client: &Client, values: &[f32], shape: impl Into<Shape>) -> Self {
        Self::from_values(client, values, shape)
    }

    /// The elements, row-major, read back to the host (waits for the device).
    ///
    /// # Panics
    ///
    /// If `E` is not the tensor's dtype or the device cannot be read.
    pub fn read<E: CubeElement + Scalar>(&self) -> Vec<E> {
        assert_eq!(E::elem_type_native(), self.dtype, "read as its own dtype");
        let contiguous = self.clone().into_contiguous();
        let client = contiguous.client.clone();
        let bytes =
            client.read_one_unchecked_tensor(contiguous.into_handle().into_copy_descriptor());
        E::from_bytes(&bytes).to_vec()
    }

    /// A tensor of `client`'s device from CubeCL's own tensor handle.
    pub fn from_handle(client: Client, handle: TensorHandle) -> Self {
        Self {
            client,
            handle: handle.handle,
            meta: handle.metadata,
            dtype: handle.dtype,
        }
    }

    /// This tensor as CubeCL's own tensor handle.
    pub fn into_handle(self) -> TensorHandle {
        TensorHandle::from_metadata(self.handle, *self.meta, self.dtype)
    }

    /// The kernel argument that reads and writes this tensor.
    pub fn into_tensor_arg(self) -> TensorArg {
        self.into_handle().into_arg()
    }

    /// The address width every index into this tensor's buffer fits (64 bits while
    /// [`force_wide_indices`](crate::testing::force_wide_indices) lives).
    pub fn required_address_type(&self) -> AddressType {
        if crate::testing::wide_indices_forced() {
            return AddressType::U64;
        }
        AddressType::from_len(self.handle.size() as usize / self.dtype.size())
    }

    /// Whether the elements lie row after row with no gap.
    pub fn is_contiguous(&self) -> bool {
        cubecl::std::tensor::is_contiguous(self.meta.shape(), self.meta.strides())
    }

    /// This contiguous tensor seen with another shape of as many elements, row-major.
    pub fn reshaped<const N: usize>(self, shape: [usize; N]) -> Self {
        assert!(
            self.is_contiguous() && shape.iter().product::<usize>() == self.meta.num_elements(),
            "a reshape of a contiguous tensor, element count kept"
        );
        let mut strides = [1usize; N];
        for dim in (1..N).rev() {
            strides[dim - 1] = strides[dim] * shape[dim];
        }
        Self::new(self.client, self.handle, shape, strides, self.dtype)
    }

    /// This tensor's metadata with its last dim cut to one element: for a kernel that reads
    /// the tensor through a tensor map and takes from it only its other dims.
    pub(crate) fn with_unit_rows(&self) -> Self {
        let mut shape = self.meta.shape().to_vec();
        *shape.last_mut().expect("a tensor of rank one or more") = 1;
        let strides = self.meta.strides().to_vec();
        Self::new(
            self.client.clone(),
            self.handle.clone(),
            shape,
            strides,
            self.dtype,
        )
    }

    /// This tensor with dims `a` and `b` exchanged: the same elements, read through swapped
    /// strides.
    pub fn swapped(self, a: usize, b: usize) -> Self {
        let mut shape = self.meta.shape().to_vec();
        let mut strides = self.meta.strides().to_vec();
        shape.swap(a, b);
        strides.swap(a, b);
        Self::new(self.client, self.handle, shape, strides, self.dtype)
    }

    /// This `[b, h, seq, dim]` tensor read in place where each head's rows lie one after the
    /// other, whatever lies between heads and batches (a prefix of a longer sequence, as the
    /// filled part of a key/value cache), with its start and strides whole 16-byte units (the
    /// stages' copies and tensor maps); else a contiguous copy.
    pub fn into_head_rows(self) -> Self {
        let (shape, strides) = (self.meta.shape(), self.meta.strides());
        let head_rows = strides[3] == 1 && (shape[2] <= 1 || strides[2] == shape[3]);
        if head_rows && tma_aligned(&self) {
            if !self.is_contiguous() {
                crate::testing::record_view_in_place();
            }
            self
        } else {
            self.into_contiguous()
        }
    }

    /// This tensor read in place where its rows (the last dim) are contiguous and its start and
    /// every stride are whole 16-byte units, whatever the order of its other dims (a paged
    /// cache's `[pages, page_size, heads, dim]` read as `[pages, heads, page_size, dim]`); else
    /// a contiguous copy.
    pub fn into_aligned_rows(self) -> Self {
        if tma_aligned(&self) {
            self
        } else {
            self.into_contiguous()
        }
    }

    /// This tensor, copied into a contiguous one where it is not.
    pub fn into_contiguous(self) -> Self {
        if self.is_contiguous() {
            return self;
        }
        let client = self.client.clone();
        let dtype = self.dtype;
        let copy = into_contiguous(&client, self.into_handle().binding(), dtype);
        Self::from_handle(client, copy)
    }
}

/// The mask and bias inputs of a launch, contiguous, the mask's booleans as integers.
#[derive(Clone, Debug)]
pub struct ScoreInputs {
    /// `[b|1, h|1, sq|1, sk]`, `true` (bit 0 set) hides the pair.
    pub mask: Option<KernelTensor>,
    /// `[b|1, h|1, sq|1, sk]`, in the inputs' dtype.
    pub bias: Option<KernelTensor>,
}

impl ScoreInputs {
    /// These inputs as broadcasts ([`broadcast_view`]), made contiguous. The mask holds
    /// integers (a runtime's booleans are cast to integers by the caller).
    ///
    /// # Panics
    ///
    /// If the mask's dtype is not an integer type.
    pub fn new(mask: Option<KernelTensor>, bias: Option<KernelTensor>) -> Self {
        if let Some(mask) = &mask {
            assert!(
                matches!(mask.dtype, ElemType::UInt(_) | ElemType::Int(_)),
                "a mask is read as integers, not {:?}",
                mask.dtype
            );
        }
        Self {
            mask: mask.map(broadcast_view),
            bias: bias.map(broadcast_view),
        }
    }

    /// The facts of these inputs the plans decide on.
    pub(crate) fn facts(&self) -> ScoreFacts {
        let facts = |t: &KernelTensor| {
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
    pub(crate) fn mask_dtype(&self) -> ElemType {
        self.mask.as_ref().map_or(U8, |mask| mask.dtype)
    }

    /// The address width the kernels need to index the mask and bias.
    pub(crate) fn address_type(&self) -> AddressType {
        address_type(&self.mask.iter().chain(&self.bias).collect::<Vec<_>>())
    }

    pub(crate) fn mask_arg(&self) -> Option<TensorArg> {
        self.mask.clone().map(KernelTensor::into_tensor_arg)
    }

    pub(crate) fn bias_arg(&self) -> Option<TensorArg> {
        self.bias.clone().map(KernelTensor::into_tensor_arg)
    }
}

/// `input` (`[b, h, sq, sk]`) read as the broadcast it is: a batch, head or query dim expanded
/// with stride 0 (as `Tensor::expand` leaves one) gets size 1, which every kernel broadcasts,
/// rather than being copied out to its full size; what is then still not contiguous is copied.
fn broadcast_view(mut input: KernelTensor) -> KernelTensor {
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
    input.into_contiguous()
}

/// The keys of a cache as the forward reads them ([`forward`](crate::kernel::forward)): each
/// sequence's length, and in a paged cache the block table, both u32 or both i32.
#[derive(Clone, Debug)]
pub struct CachedKeys {
    /// `[b]`: the keys sequence `b` holds (a length past the keys' rows counts as all of them, a
    /// negative one as none).
    pub lengths: KernelTensor,
    /// `[b, pages per sequence]`: the page holding each run of `page_size` keys of a sequence,
    /// where K and V are paged, `[pages, kv_heads, page_size, dim]`.
    pub block_table: Option<KernelTensor>,
}

/// Sequences of different lengths packed one after another along the rows of one
/// `[1, heads, total, dim]` tensor per operand, as the forward reads them
/// ([`forward_packed`](crate::kernel::forward_packed)).
#[derive(Clone, Debug)]
pub struct PackedRows {
    /// `[2, sequences + 1]` u32: the cumulative query lengths (row 0) and key lengths (row 1),
    /// from 0; sequence `b`'s queries are rows `starts[0, b]..starts[0, b + 1]`.
    pub starts: KernelTensor,
    /// The longest sequence's queries: the launch's row blocks per (sequence, head).
    pub max_query: usize,
    /// The longest sequence's keys.
    pub max_key: usize,
}

impl PackedRows {
    /// These rows with their starts contiguous.
    ///
    /// # Panics
    ///
    /// Where the starts are not `[2, sequences + 1]` u32.
    pub(crate) fn checked(self) -> Self {
        let starts = &self.starts;
        assert!(
            starts.dtype == U32 && starts.meta.shape().len() == 2 && starts.meta.shape()[0] == 2,
            "packed starts are [2, sequences + 1] u32, not {:?} {:?}",
            starts.meta.shape(),
            starts.dtype
        );
        Self {
            starts: self.starts.into_contiguous(),
            ..self
        }
    }
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
pub(crate) fn output(like: &KernelTensor, shape: Shape, dtype: ElemType) -> KernelTensor {
    let tensor = KernelTensor::empty(&like.client, shape, dtype);
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
    #[define(F)] _dtype: ElemType,
) {
    if ABSOLUTE_POS < tensor.len() {
        tensor[ABSOLUTE_POS] = Vector::new(F::cast_from(value));
    }
}

fn poison(tensor: &KernelTensor) {
    fill_tensor(tensor, f32::NAN);
}

/// The widest vector the client moves in one access that divides the last dim of each of
/// `tensors` and all their other strides (1 when none does).
pub(crate) fn vector_width(tensors: &[&KernelTensor]) -> usize {
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
pub(crate) fn address_type(tensors: &[&KernelTensor]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// Set every element of a contiguous tensor to `value`, a vector per unit.
pub(crate) fn fill_tensor(tensor: &KernelTensor, value: f32) {
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
            tensor.dtype,
        );
    }
}

/// With `cfg.tma`, a tensor map of `t` (`[b, h, seq, cfg.head_dim]`) whose box is one stage's
/// rows (`cfg.block_kv`) by 64 columns, one 128-byte line each, with the 128-byte swizzle the
/// stages are read with: one box per stage at head dim 64, one per panel of 64 columns wider
/// ([`TileConfig::staged_pitch`]).
pub(crate) fn stage_map(t: &KernelTensor, cfg: &TileConfig) -> Option<TensorMapArg<Tiled>> {
    stage_map_of(|| t.clone().into_tensor_arg(), t.dtype, cfg)
}

/// [`stage_map`] of the tensor argument `tensor` makes, of `dtype`.
pub(crate) fn stage_map_of(
    tensor: impl FnOnce() -> TensorArg,
    dtype: ElemType,
    cfg: &TileConfig,
) -> Option<TensorMapArg<Tiled>> {
    cfg.tma.then(|| {
        let tile = Shape::new([1, 1, cfg.block_kv, 8 * CHUNK]);
        TensorMapArg::new(TiledArgs::new(tile), tensor(), dtype)
            .with_swizzle(TensorMapSwizzle::B128)
    })
}

/// Whether `t` can be read through a tensor map ([`layout_tma_aligned`]).
pub(crate) fn tma_aligned(t: &KernelTensor) -> bool {
    let offset = t.handle.offset_start.unwrap_or(0);
    layout_tma_aligned(offset, t.meta.strides(), t.dtype.size())
}

/// Whether a tensor starting `offset` bytes into its buffer, with these strides (in elements
/// of `elem_size` bytes), can be read through a tensor map: its start and every stride but the
/// unit one are whole 16-byte units.
pub(crate) fn layout_tma_aligned(offset: u64, strides: &[usize], elem_size: usize) -> bool {
    offset.is_multiple_of(16)
        && strides[strides.len() - 1] == 1
        && strides
            .iter()
            .all(|s| (s * elem_size).is_multiple_of(16) || *s == 1)
}
