#include "batch_record.h"

#include <torch/torch.h>

#include "../run_files.h"
#include "framefit/models/torchscript.h"

namespace framefit::train::detail {

namespace {

constexpr const char* kFormat = "framefit-checkpoint-1";

// [S,3]: begin, end, 0 stored, 1 recomputed, 2 nested.
torch::Tensor segments_tensor(const std::vector<engine::ChainSegment>& segments) {
  std::vector<int64_t> rows;
  for (const auto& g : segments) {
    rows.insert(rows.end(), {g.begin, g.end, g.recompute ? (g.nested ? 2 : 1) : 0});
  }
  return torch::tensor(rows, torch::kLong).view({-1, 3});
}

std::vector<engine::ChainSegment> segments_from(const torch::Tensor& tensor) {
  std::vector<engine::ChainSegment> segments;
  const auto rows = tensor.accessor<int64_t, 2>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    segments.push_back({rows[i][0], rows[i][1], rows[i][2] != 0, rows[i][2] == 2});
  return segments;
}

}  // namespace

void write_network(torch::serialize::OutputArchive& archive, const BatchModel& model) {
  archive.write("format", c10::IValue(std::string(kFormat)));
  archive.write("config", c10::IValue(to_yaml(model.config)));
  archive.write("input", torch::tensor(model.input, torch::kLong));
  torch::serialize::OutputArchive network;
  model.network.module->save(network);
  archive.write("network", network);
  if (auto script = std::dynamic_pointer_cast<models::TorchScriptEncoderImpl>(model.network.module))
    write_script(archive, *script);
}

void write_progress(torch::serialize::OutputArchive& archive, const BatchProgress& p) {
  write_run_record(archive, {p,
                             {{"batch", p.batch},
                              {"micro_batches", p.micro_batches},
                              {"precision", static_cast<int64_t>(p.precision)},
                              {"lean_backward", p.lean_backward},
                              {"eval_batch", p.eval_batch},
                              {"recompute_norm", p.recompute_norm},
                              {"time_slices", p.time_slices}},
                             {{"segments", segments_tensor(p.segments)},
                              {"fallback_segments", segments_tensor(p.fallback_segments)}}});
}

namespace {

// Format 1: step, epoch, position, skipped, batch, micro_batches, precision, then added one by
// one lean_backward, eval_batch, stale_epochs, recompute_norm, time_slices in one int64 tensor;
// best score and seconds in a double one; the segments beside them. `p`: the first, already read.
BatchProgress read_first_format_batch_progress(torch::serialize::InputArchive& archive,
                                               const torch::Tensor& p) {
  torch::Tensor r, segments;
  archive.read("progress_real", r);
  archive.read("segments", segments);
  const auto* v = p.data_ptr<int64_t>();
  BatchProgress progress;
  static_cast<RunPosition&>(progress) = first_format_position(p, r);
  progress.batch = v[4];
  progress.micro_batches = v[5];
  progress.precision = static_cast<engine::Precision>(v[6]);
  // Checkpoints from before the lean backward ran every convolution's backward through oneDNN.
  progress.lean_backward = p.numel() > 7 && v[7] != 0;
  // ... and evaluated at the training batch.
  progress.eval_batch = p.numel() > 8 ? v[8] : progress.batch;
  progress.stale_epochs = p.numel() > 9 ? v[9] : 0;        // ... and had no train.patience
  progress.recompute_norm = p.numel() > 10 && v[10] != 0;  // ... and kept every BatchNorm input
  progress.time_slices = p.numel() > 11 ? v[11] : 0;       // ... and ran convolutions whole
  progress.segments = segments_from(segments);
  // Older checkpoints have none: their runs fell back on every stage recomputed.
  torch::Tensor fallback;
  if (archive.try_read("fallback_segments", fallback)) {
    progress.fallback_segments = segments_from(fallback);
  }
  return progress;
}

}  // namespace

BatchProgress read_batch_progress(torch::serialize::InputArchive& archive,
                                  const std::string& checkpoint) {
  const auto record = read_run_record(archive, checkpoint);
  if (!record) {
    torch::Tensor progress;
    TORCH_CHECK(archive.try_read("progress", progress), "checkpoint ", checkpoint,
                " records no run (no training position): resume from a checkpoint that "
                "framefit train wrote");
    return read_first_format_batch_progress(archive, progress);
  }
  BatchProgress p;
  static_cast<RunPosition&>(p) = record->position;
  p.batch = record->setting("batch", 0);
  p.micro_batches = record->setting("micro_batches", 1);
  p.precision = static_cast<engine::Precision>(record->setting("precision", 0));
  p.lean_backward = record->setting("lean_backward", 0) != 0;
  p.eval_batch = record->setting("eval_batch", p.batch);
  p.recompute_norm = record->setting("recompute_norm", 0) != 0;
  p.time_slices = record->setting("time_slices", 0);
  for (auto [name, segments] :
       {std::pair{"segments", &p.segments}, {"fallback_segments", &p.fallback_segments}}) {
    if (const auto tensor = record->tensor(name); tensor.defined())
      *segments = segments_from(tensor);
  }
  return p;
}

}  // namespace framefit::train::detail
