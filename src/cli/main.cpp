#include <fmt/core.h>

#include <functional>
#include <map>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/memory/tracker.h"

int main(int argc, char** argv) {
  using namespace framefit;
  const auto parsed = cli::parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  if (!parsed.args) {
    fmt::print(parsed.exit_code == 0 ? stdout : stderr, "{}", parsed.output);
    return parsed.exit_code;
  }
  const cli::Args& args = *parsed.args;
  static const std::map<std::string, std::function<int(const cli::Args&)>> commands = {
      {"extract", cli::run_extract},
      {"bench-step", cli::run_bench_step},
      {"bench-memory", cli::run_bench_memory},
      {"plan", cli::run_plan},
      {"doctor", cli::run_doctor},
      {"bench-layers", cli::run_bench_layers},
      {"make-demo", cli::run_make_demo},
      {"train", cli::run_train},
      {"eval", cli::run_eval},
      {"predict", cli::run_predict},
      {"export", cli::run_export},
      {"bench-data", cli::run_bench_data},
  };
  try {
    RuntimeOptions runtime;
    if (args.has("threads")) runtime.threads = static_cast<int>(args.integer("threads"));
    configure_runtime(runtime);
    return commands.at(args.command())(args);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "framefit {}: error: {}\n", args.command(), e.what_without_backtrace());
    return memory::is_out_of_memory(e) ? 3 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "framefit {}: error: {}\n", args.command(), e.what());
    return 1;
  }
}
