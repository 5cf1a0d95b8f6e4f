#pragma once
// The tasks train() runs (train/task.h), one file each under src/train/tasks/, and what their
// data loading shares. Private to src/train.
#include <vector>

#include "framefit/data/dataset.h"
#include "framefit/train/config.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"
#include "plans.h"

namespace framefit::train::detail {

const Task& phases_task();  // tasks/phases.cpp
const Task& batch_task();   // tasks/batch.cpp: clips and segmentation

// Task::read_split's timing: `jobs` (a split's units, each loaded as training loads it) through
// data.workers prefetching threads within data.prefetch_bytes, timed from the first job on
// (opening the data set, which probes every video, is not reading it). Counts units and samples
// and takes the first unit's size; the names are the caller's to fill.
DataThroughput time_loading(std::vector<data::Prefetcher::Job> jobs, const Config& config);

// Task::plan's record and lines for each kind of plan (tasks/run_plans.cpp).
RunPlan phase_run_plan(const Config& config, const PhasePlan& plan);
RunPlan batch_run_plan(const Config& config, const BatchTaskPlan& plan);

}  // namespace framefit::train::detail
