#pragma once
// What a training run says and asks while it runs. The library never prints: progress, notes
// and warnings arrive as Events through the caller's callback (the CLI prints them, a test
// collects them), and the caller's StopRequest ends a run at a step boundary.
#include <cstdint>
#include <functional>
#include <string>

#include "framefit/train/metrics.h"

namespace framefit::train {

struct Event {
  enum class Kind { Info, Warning, Step, Epoch, Evaluate };
  Kind kind = Kind::Info;
  std::string message;  // Info and Warning
  // Step: after each optimizer step. Evaluate: after each evaluated video (step = videos done).
  int64_t step = 0, total_steps = 0;
  int64_t epoch = 0, epochs = 0;  // 1-based
  double loss = 0, lr = 0;
  double frames_per_second = 0, elapsed_seconds = 0, eta_seconds = 0;
  std::string rate_unit = "frames";  // what frames_per_second counts (clips and images: samples)
  int64_t peak_bytes = 0;            // tracked tensor peak of the step
  int64_t rss_bytes = 0;             // resident set size now
  // Time spent getting data (waiting for the decoding workers, assembling the batch) instead
  // of training: Step, that step's seconds; Epoch, the epoch's seconds and their fraction of its
  // training time (data and steps, without validation). A large fraction means the input
  // pipeline, not the model, sets the speed (and, on a GPU, that the device sits idle).
  double data_seconds = 0, data_fraction = 0;
  // Epoch: the epoch's mean training loss and, when validated, the metrics.
  bool validated = false;
  bool best = false;  // this epoch's validation is the best so far (best.pt written)
  PhaseMetrics metrics;

  static Event note(Kind kind, std::string text) {
    Event e;
    e.kind = kind;
    e.message = std::move(text);
    return e;
  }
};
using EventCallback = std::function<void(const Event&)>;

// Asked after every optimizer step and at the end of every epoch: true ends the run there with
// a checkpoint that resumes it exactly (the CLI asks on SIGINT and SIGTERM). Empty: never.
using StopRequest = std::function<bool()>;

}  // namespace framefit::train
