//! The one error every boundary check returns.

/// A size mismatch at a boundary: which buffer, which axis, expected and actual.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}: axis {axis}: expected {expected}, got {actual}{hint}")]
pub struct ShapeError {
    /// What was being checked, e.g. `capture "input:30"` or a tensor name.
    pub context: String,
    /// The axis name: `layers`, `tokens`, `hidden`, `elements`, ...
    pub axis: &'static str,
    /// The size the type or the config demands.
    pub expected: usize,
    /// The size that arrived.
    pub actual: usize,
    hint: &'static str,
}

impl ShapeError {
    /// A mismatch, with a hint when the numbers look like a known bug class.
    pub fn new(context: impl Into<String>, axis: &'static str, expected: usize, actual: usize) -> Self {
        let hint = if actual != 0 && actual < expected && expected.is_multiple_of(actual) && axis == "hidden" {
            " (tensor-parallel shard?)"
        } else {
            ""
        };
        ShapeError { context: context.into(), axis, expected, actual, hint }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_axis_and_hints_at_shards() {
        let e = ShapeError::new("capture \"input:30\"", "hidden", 7168, 896);
        assert_eq!(e.to_string(), "capture \"input:30\": axis hidden: expected 7168, got 896 (tensor-parallel shard?)");
        let e = ShapeError::new("t", "tokens", 10, 5);
        assert_eq!(e.to_string(), "t: axis tokens: expected 10, got 5");
    }
}
