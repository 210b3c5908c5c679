//! Layout bugs that must not compile. Each `tests/ui/*.rs` has a `.stderr`
//! with the compiler's verdict; trybuild fails if one compiles, or fails for
//! another reason than the recorded one.

#[test]
fn layout_bugs_do_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
