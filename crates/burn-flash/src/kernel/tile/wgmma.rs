//! Warpgroup matrix products (`wgmma.mma_async`, SM90a), the instruction of the Hopper forward
//! ([`warpgroup`](crate::kernel::forward::warpgroup)). CubeCL 0.12 lowers its own `wgmma` API
//! only on its LLVM code path, and this crate compiles CUDA through the C++ one (for
//! `cp.async`), so the products are inline PTX. One `gpu_asm!` holds a product's fence, every
//! k-step and the commit: ptxas serialises products whose k-steps are split over several
//! (nvcc 13, H200). The accumulators a unit holds of a 64-row f32 tile (`n / 2` of an `n`-wide
//! one) come out as one vector (a `gpu_asm!` has one output).

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::generic_to_shared;

/// Where element `(row, col)` of a tile of 16-bit values 64 columns wide (128 bytes a row)
/// lies in shared memory with the 128-byte swizzle: the 16-byte chunk `c` of row `r` at chunk
/// `c ^ (r % 8)`, the layout a tensor map's `B128` swizzle writes and the descriptors below
/// read. The tile must start on a 1024-byte boundary.
#[cube]
pub fn swizzled(row: usize, col: usize) -> usize {
    row * 64 + (((col / 8) ^ (row % 8)) * 8) + col % 8
}

/// The matrix descriptor of a tile of 16-bit values in shared memory, K-major (64 values of
/// the reduced dim a row), [`swizzled`], starting at `tile`'s first element: its shared
/// address in 16-byte units, 1024 bytes from one group of 8 rows to the next, the 128-byte
/// swizzle. A k-step of 16 values further is 2 more (32 bytes).
#[cube]
pub fn descriptor<E: CubePrimitive>(tile: &Shared<[E]>) -> u64 {
    let address = u64::cast_from(generic_to_shared::<E>(tile.as_ptr()));
    // Leading byte offset 1 (unused with the swizzle), stride byte offset 1024 / 16, mode 1.
    ((address >> 4) & 0x3FFF) | (1u64 << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// `S = A · Bᵀ` for the 64 rows of A the warpgroup owns (its 128 units call it together)
/// against `n` rows of B, over `depth` values of the reduced dim, 16-bit in (`bf16` or f16) and
/// f32 out (`N` = `n / 2` accumulators a unit, at [`position`]): `a` and `b` the [`descriptor`]s
/// of the first rows, each operand stored as panels of 64 columns of `a_rows` and `n` rows.
/// Issued, not finished: [`wait_products`] before reading the result.
#[cube]
pub fn product<N: Size>(
    a: u64,
    b: u64,
    #[comptime] a_rows: usize,
    #[comptime] n: usize,
    #[comptime] depth: usize,
    #[comptime] bf16: bool,
) -> Vector<f32, N> {
    let body = comptime![shared_product_ptx(
        n,
        ptx_type(bf16),
        &k_major_steps(a_rows as u64, depth as u64 / 16),
        &k_major_steps(n as u64, depth as u64 / 16),
        false
    )];
    issue_shared_product::<N>(a, b, body)
}

/// `D = A · B` for the 64 rows of A the warpgroup owns against `n` columns of B, over `depth`
/// values of the reduced dim, both operands stored as rows of the reduced dim and read across
/// them ([`descriptor_across_rows`]: A as `depth` rows of its 64 values, B as `depth` rows of
/// its `n`, panels of 64 columns): what a backward's `dQ = dS · K` reads from `dSᵀ` and `K`
/// staged as they are. 16-bit in, f32 out at [`position`]. Issued, not finished:
/// [`wait_products`] before reading the result.
#[cube]
pub fn product_across_rows<N: Size>(
    a: u64,
    b: u64,
    #[comptime] n: usize,
    #[comptime] depth: usize,
    #[comptime] bf16: bool,
) -> Vector<f32, N> {
    let body = comptime![shared_product_ptx(
        n,
        ptx_type(bf16),
        &across_rows_steps(depth as u64 / 16),
        &across_rows_steps(depth as u64 / 16),
        true
    )];
    issue_shared_product::<N>(a, b, body)
}

/// The `gpu_asm!` of a [`shared_product_ptx`] `body`: accumulators out, A's and B's descriptors in.
#[cube]
fn issue_shared_product<N: Size>(a: u64, b: u64, #[comptime] body: String) -> Vector<f32, N> {
    let d: Vector<f32, N>;
    gpu_asm!("{body}", "// {d} {a} {b}", d = out(_) d, a = in(_) a, b = in(_) b);
    d
}

/// The matrix descriptor of a tile of 16-bit values read across its rows (the B operand
/// transposed: rows of the reduced dim, `n` values of the other each), stored as panels of 64
/// columns ([`swizzled`] within each), `panel_bytes` apart, starting at `tile`'s first element:
/// the leading offset is the step from one panel to the next along the `n` values (unused where
/// `n` is 64), the stride offset the 1024 bytes from one group of 8 rows to the next. A k-step
/// of 16 rows further is 128 more (2048 bytes).
#[cube]
pub fn descriptor_across_rows<E: CubePrimitive>(
    tile: &Shared<[E]>,
    #[comptime] panel_bytes: u64,
) -> u64 {
    let address = u64::cast_from(generic_to_shared::<E>(tile.as_ptr()));
    let leading = comptime!(panel_bytes >> 4);
    ((address >> 4) & 0x3FFF) | (leading << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// `O + P · V` for the 64 rows the warpgroup owns over `keys` keys, `n` value columns, 16-bit
/// in and f32 out: `o` the `N` = `n / 2` accumulators a unit holds, `p` the probabilities in
/// registers (`F` = `keys / 4`, at [`fragment_position`]), `v` the [`descriptor_across_rows`]
/// of the first key row of V. Issued, not finished: [`wait_products`] before reading the
/// result. The accumulators pass in and out as separate operands (a `gpu_asm!` operand is one
/// or the other), copied at the start.
#[cube]
pub fn product_pv<N: Size, F: Size>(
    o: Vector<f32, N>,
    p: Vector<u32, F>,
    v: u64,
    #[comptime] keys: usize,
    #[comptime] n: usize,
    #[comptime] bf16: bool,
) -> Vector<f32, N> {
    let body = comptime![register_product_ptx(
        n,
        ptx_type(bf16),
        &across_rows_steps(keys as u64 / 16)
    )];
    let d: Vector<f32, N>;
    gpu_asm!(
        "{body}",
        "// {d} {o} {p} {v}",
        d = out(_) d,
        // Read as values: a `gpu_asm!` input takes a mutable local by its address.
        o = in(_) Vector::<f32, N>::reinterpret(o),
        p = in(_) Vector::<u32, F>::reinterpret(p),
        v = in(_) v,
    );
    d
}

/// How PTX names the 16-bit input type.
fn ptx_type(bf16: bool) -> &'static str {
    if bf16 { "bf16" } else { "f16" }
}

/// Each k-step's offset, in 16-byte units, in a K-major [`descriptor`] of `rows` rows: 32 bytes
/// a step within a 64-column panel, a panel (`rows` × 128 bytes) for each 4 steps.
fn k_major_steps(rows: u64, steps: u64) -> Vec<u64> {
    (0..steps).map(|s| s / 4 * rows * 8 + s % 4 * 2).collect()
}

/// Each k-step's offset, in 16-byte units, in a [`descriptor_across_rows`]: 16 rows of 128
/// bytes a step.
fn across_rows_steps(steps: u64) -> Vec<u64> {
    (0..steps).map(|s| s * 128).collect()
}

/// `count` registers from `%first` as a PTX vector operand.
fn registers(first: usize, count: usize) -> String {
    let list: Vec<String> = (first..first + count).map(|r| format!("%{r}")).collect();
    format!("{{{}}}", list.join(", "))
}

/// One `m64n{n}k16` step, `ty` in and f32 out, into the accumulators `d`.
fn mma_step(
    n: usize,
    ty: &str,
    d: &str,
    a: &str,
    b: &str,
    scale_d: &str,
    immediates: &str,
) -> String {
    format!(
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {d}, {a}, {b}, {scale_d}, {immediates};"
    )
}

/// The PTX of a warpgroup product with both operands in shared memory, `D = A · B` over one
/// k-step per entry of `a_steps` / `b_steps` (the descriptors' offsets, the first 0), both read
/// K-major or, `transposed`, both across their rows: the fence, the steps (the first
/// overwriting `D`), the commit. Its operands as CubeCL numbers them: the `n / 2` accumulators
/// out (`%0..`), A's descriptor, B's.
fn shared_product_ptx(
    n: usize,
    ty: &str,
    a_steps: &[u64],
    b_steps: &[u64],
    transposed: bool,
) -> String {
    assert!(a_steps.len() == b_steps.len() && a_steps[0] == 0 && b_steps[0] == 0);
    let d = registers(0, n / 2);
    let (a, b) = (format!("%{}", n / 2), format!("%{}", n / 2 + 1));
    let mut lines: Vec<String> = [
        "{",
        ".reg .pred fresh, add;",
        ".reg .b32 zero;",
        ".reg .b64 da, db;",
        "mov.b32 zero, 0;",
        "setp.ne.b32 fresh, zero, 0;",
        "setp.eq.b32 add, zero, 0;",
        "wgmma.fence.sync.aligned;",
    ]
    .map(String::from)
    .into();
    // Scale A and B by 1, and transpose both or neither.
    let immediates = if transposed {
        "1, 1, 1, 1"
    } else {
        "1, 1, 0, 0"
    };
    lines.push(mma_step(n, ty, &d, &a, &b, "fresh", immediates));
    for (da, db) in a_steps.iter().zip(b_steps).skip(1) {
        lines.push(format!("add.s64 da, {a}, {da};"));
        lines.push(format!("add.s64 db, {b}, {db};"));
        lines.push(mma_step(n, ty, &d, "da", "db", "add", immediates));
    }
    lines.extend(["wgmma.commit_group.sync.aligned;", "}"].map(String::from));
    lines.join("\n")
}

/// The PTX of a warpgroup product with A in registers, `D = C + A · Bᵀ`, B read across its
/// rows, over one k-step per entry of `b_steps` (the descriptor's offsets, the first 0): `C`
/// copied to `D`, the fence, the steps, the commit. Its operands as CubeCL numbers them: the
/// `n / 2` accumulators out (`%0..`), the `n / 2` in, A's 4 registers a step, B's descriptor.
fn register_product_ptx(n: usize, ty: &str, b_steps: &[u64]) -> String {
    assert!(b_steps[0] == 0);
    let (half, steps) = (n / 2, b_steps.len());
    let d = registers(0, half);
    let b = format!("%{}", n + 4 * steps);
    let mut lines: Vec<String> = [
        "{",
        ".reg .pred add;",
        ".reg .b32 zero;",
        ".reg .b64 dv;",
        "mov.b32 zero, 0;",
        "setp.eq.b32 add, zero, 0;",
    ]
    .map(String::from)
    .into();
    lines.extend((0..half).map(|i| format!("mov.b32 %{i}, %{};", half + i)));
    lines.push("wgmma.fence.sync.aligned;".into());
    for (step, offset) in b_steps.iter().enumerate() {
        let a = registers(n + 4 * step, 4);
        if step == 0 {
            lines.push(mma_step(n, ty, &d, &a, &b, "add", "1, 1, 1"));
        } else {
            lines.push(format!("add.s64 dv, {b}, {offset};"));
            lines.push(mma_step(n, ty, &d, &a, "dv", "add", "1, 1, 1"));
        }
    }
    lines.extend(["wgmma.commit_group.sync.aligned;", "}"].map(String::from));
    lines.join("\n")
}

/// Wait for every product this warpgroup issued.
#[cube]
pub fn wait_products() {
    gpu_asm!("wgmma.wait_group.sync.aligned 0;");
}

/// Row and column of accumulator `nth` of unit `unit` (0..128) in the 64 × 64 tile: warp `w`
/// holds rows `16w..16w + 16`; within it as `mma.sync`'s m16n8 accumulators, one per 8 columns.
#[cube]
pub fn position(unit: usize, #[comptime] nth: usize) -> (usize, usize) {
    let (warp, lane) = (unit / 32, unit % 32);
    let row = warp * 16 + lane / 4 + comptime!((nth % 4) / 2 * 8);
    let col = comptime!(nth / 4 * 8) + (lane % 4) * 2 + comptime!(nth % 2);
    (row, col)
}

/// Row and column of the first of the two values register `nth` of a unit's [`Fragment`]
/// packs (the second is the next column): as `mma.sync`'s m16n8k16 A operand per warp and
/// k-step, so that the accumulators of `S` at [`position`] are the values of `P` here.
#[cube]
pub fn fragment_position(unit: usize, #[comptime] nth: usize) -> (usize, usize) {
    let (warp, lane) = (unit / 32, unit % 32);
    let row = warp * 16 + lane / 4 + comptime!(nth % 2 * 8);
    let col = comptime!(nth / 4 * 16 + (nth % 4) / 2 * 8) + (lane % 4) * 2;
    (row, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX of the two products as CubeCL printed it for the kernels whose tests passed on
    /// an NVIDIA H200 on 2026-11-29 (written out by hand then, `docs/hopper.md`), comment
    /// lines left out: the generators must give it back exactly, so that the checked products
    /// stay the ones checked.
    const CHECKED_SHARED_PRODUCT: &str = r#"{
.reg .pred fresh, add;
.reg .b32 zero;
.reg .b64 da, db;
mov.b32 zero, 0;
setp.ne.b32 fresh, zero, 0;
setp.eq.b32 add, zero, 0;
wgmma.fence.sync.aligned;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, fresh, 1, 1, 0, 0;
add.s64 da, %32, 2;
add.s64 db, %33, 2;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
add.s64 da, %32, 4;
add.s64 db, %33, 4;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
add.s64 da, %32, 6;
add.s64 db, %33, 6;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, add, 1, 1, 0, 0;
wgmma.commit_group.sync.aligned;
}"#;
    const CHECKED_REGISTER_PRODUCT: &str = r#"{
.reg .pred add;
.reg .b32 zero;
.reg .b64 dv;
mov.b32 zero, 0;
setp.eq.b32 add, zero, 0;
mov.b32 %0, %32;
mov.b32 %1, %33;
mov.b32 %2, %34;
mov.b32 %3, %35;
mov.b32 %4, %36;
mov.b32 %5, %37;
mov.b32 %6, %38;
mov.b32 %7, %39;
mov.b32 %8, %40;
mov.b32 %9, %41;
mov.b32 %10, %42;
mov.b32 %11, %43;
mov.b32 %12, %44;
mov.b32 %13, %45;
mov.b32 %14, %46;
mov.b32 %15, %47;
mov.b32 %16, %48;
mov.b32 %17, %49;
mov.b32 %18, %50;
mov.b32 %19, %51;
mov.b32 %20, %52;
mov.b32 %21, %53;
mov.b32 %22, %54;
mov.b32 %23, %55;
mov.b32 %24, %56;
mov.b32 %25, %57;
mov.b32 %26, %58;
mov.b32 %27, %59;
mov.b32 %28, %60;
mov.b32 %29, %61;
mov.b32 %30, %62;
mov.b32 %31, %63;
wgmma.fence.sync.aligned;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%64, %65, %66, %67}, %80, add, 1, 1, 1;
add.s64 dv, %80, 128;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%68, %69, %70, %71}, dv, add, 1, 1, 1;
add.s64 dv, %80, 256;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%72, %73, %74, %75}, dv, add, 1, 1, 1;
add.s64 dv, %80, 384;
wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%76, %77, %78, %79}, dv, add, 1, 1, 1;
wgmma.commit_group.sync.aligned;
}"#;

    #[test]
    fn generated_ptx_is_the_checked_ptx() {
        assert_eq!(
            shared_product_ptx(
                64,
                "bf16",
                &k_major_steps(64, 4),
                &k_major_steps(64, 4),
                false
            ),
            CHECKED_SHARED_PRODUCT
        );
        assert_eq!(
            register_product_ptx(64, "bf16", &across_rows_steps(4)),
            CHECKED_REGISTER_PRODUCT
        );
        // Head dim 128: the fifth k-step starts the second 64-column panel of 64 rows.
        assert_eq!(k_major_steps(64, 8), [0, 2, 4, 6, 512, 514, 516, 518]);
    }
}
