//! Layout bugs that must not compile. Each `tests/ui/*.rs` has a `.stderr`
//! with the compiler's verdict; trybuild fails if one compiles, or fails for
//! another reason than the recorded one.
//!
//! With the CUDA backend, `tests/ui_cuda/*.rs` too: a kernel launched with
//! arguments its declaration does not take (build.rs makes each kernel's
//! typed launcher from its signature in `kernels/*.cu`). One `TestCases`, so
//! trybuild builds the crate once for both.

#[test]
fn layout_bugs_do_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    #[cfg(feature = "cuda")]
    t.compile_fail("tests/ui_cuda/*.rs");
}
