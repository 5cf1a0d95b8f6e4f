// The one training loop's entry: the config's task starts a run in its folder, and run_epochs
// drives it. Where a training run is composed: the device's tracker is taken here and handed on.
#include <torch/torch.h>

#include <chrono>

#include "framefit/memory/tracker.h"
#include "framefit/train/task.h"
#include "run_files.h"
#include "run_loop.h"
#include "tasks/task_kinds.h"

namespace framefit::train {

const Task& task_for(const Config& config) {
  if (is_batch_task(config)) return detail::batch_task();
  TORCH_CHECK(config.task == "phases", "task '", config.task,
              "' is not one of phases, clips, segmentation");
  return detail::phases_task();
}

TrainResult train(const Config& config, const std::string& resume, const EventCallback& on_event,
                  const StopRequest& stop) {
  const Task& task = task_for(config);
  plan::refuse_errors(task.check_settings(config));
  detail::RunFolder folder(config, resume);
  auto& tracker = memory::Tracker::of(torch::Device(config.device));
  detail::warn_if_budget_beyond_device(config, tracker, on_event);
  RunStart start;
  start.out_dir = folder.out_dir;
  start.resume_from = folder.resume_from;
  if (folder.resumed) {
    start.archive = &folder.resumed->archive;
    start.stored = &folder.resumed->stored;
  }
  const auto run = task.start(config, start, tracker, on_event);
  const auto length =
      detail::run_length(config.train, run->steps_per_epoch(), run->samples_per_step());
  const auto budget = run->budget();
  const memory::ScopedBudget budget_scope(tracker, budget.tensors, budget.held_limit());
  auto result = detail::run_epochs(*run, length, start.resumed(), tracker, stop, on_event);
  result.skipped_videos = run->skipped();
  return result;
}

DataThroughput detail::time_loading(std::vector<data::Prefetcher::Job> jobs, const Config& config) {
  DataThroughput out;
  const auto start = std::chrono::steady_clock::now();
  data::Prefetcher prefetcher(std::move(jobs), static_cast<int>(config.data.workers),
                              config.data.prefetch_bytes);
  while (!prefetcher.done()) {
    const Video unit = prefetcher.next();
    const bool features = unit.features.defined();
    const auto& loaded = features ? unit.features : unit.frames;
    if (out.units++ == 0) {
      if (features) {
        out.feature_dim = loaded.size(1);
      } else {
        out.height = loaded.size(-2);
        out.width = loaded.size(-1);
      }
    }
    out.samples += loaded.size(0);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

Evaluation evaluate_checkpoint(const EvaluationRequest& request, const EventCallback& on_event) {
  return task_for(checkpoint_config(request.checkpoint)).evaluate(request, on_event);
}

DataThroughput read_split(const Config& config, const std::string& split,
                          const EventCallback& on_event) {
  return task_for(config).read_split(config, split, on_event);
}

}  // namespace framefit::train
