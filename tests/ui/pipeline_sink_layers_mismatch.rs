// Four capture points feeding a writer declared for three layers.
use strata::pipeline::capture::CaptureSet;
use strata::model::Llama;
use strata::job::Pipeline;
use strata::shape::{Hidden, Layers};
use strata::sink::StrataSink;
use strata::pipeline::source::JsonlSource;

fn job(
    model: &Llama<Hidden<4096>>,
    captures: CaptureSet<Layers<4>>,
    writer: StrataSink<Layers<3>, Hidden<4096>>,
    source: JsonlSource<&[u8]>,
) {
    let _ = Pipeline::new(source).model(model).capture(captures).sink(writer);
}

fn main() {}
