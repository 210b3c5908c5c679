// A writer declared for hidden 7168 behind a model whose hidden size is 4096.
use strata::pipeline::capture::CaptureSet;
use strata::model::Llama;
use strata::job::Pipeline;
use strata::shape::{Hidden, Layers};
use strata::sink::StrataSink;
use strata::pipeline::source::JsonlSource;

fn job(
    model: &Llama<Hidden<4096>>,
    captures: CaptureSet<Layers<4>>,
    writer: StrataSink<Layers<4>, Hidden<7168>>,
    source: JsonlSource<&[u8]>,
) {
    let _ = Pipeline::new(source).model(model).capture(captures).sink(writer);
}

fn main() {}
