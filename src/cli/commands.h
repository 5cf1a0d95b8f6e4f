#pragma once
// One function per command; each returns the process exit code. Only src/cli prints.
#include "flags.h"

namespace framefit::cli {

int run_extract(const Args& args);
int run_bench_step(const Args& args);

}  // namespace framefit::cli
