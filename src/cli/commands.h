#pragma once
// One function per command; each returns the process exit code. Only src/cli prints.
#include <map>
#include <vector>

#include "flags.h"
#include "framefit/plan/planner.h"

namespace framefit::cli {

int run_extract(const Args& args);
int run_bench_step(const Args& args);
int run_bench_memory(const Args& args);
int run_plan(const Args& args);
int run_doctor(const Args& args);
int run_make_demo(const Args& args);
int run_train(const Args& args);
int run_eval(const Args& args);
int run_predict(const Args& args);
int run_export(const Args& args);
int run_bench_data(const Args& args);
int run_bench_layers(const Args& args);

// Shared by the commands that plan (plan.cpp).
plan::ModelSpec model_spec(const Args& args);
// The request the flags describe; --chunk/--keep/... "auto" (or absent) are left to the planner.
plan::PlanRequest plan_request(const Args& args);
struct Calibrated {
  plan::StaticSizes sizes;
  std::map<engine::Precision, plan::ChunkCosts> costs;
};
// From the calibration cache, probing what is missing (announced on stderr).
Calibrated calibrate_for(const Args& args, const plan::PlanRequest& request);
// plan::fit, or with --recompute-norm auto plan::fit_recompute_norm (its costs calibrated here
// where the encoder takes it); `calibrated.costs` and request.model.recompute_norm become those
// of the choice.
plan::Plan fit_for(const Args& args, plan::PlanRequest& request, Calibrated& calibrated,
                   int64_t budget_bytes, double margin);

// One real training step (after a warm-up) with this chunk under the tracker's budget, for the
// largest-chunk finder (bench_step.cpp).
plan::ChunkTrial measure_step(const Args& args, int64_t chunk, bool recompute_norm);

// The median of timings: the upper middle one of an even count; 0 for none.
double median_of(std::vector<double> values);

}  // namespace framefit::cli
