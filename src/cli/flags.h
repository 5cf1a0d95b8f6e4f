#pragma once
// The command-line interface in one table: every command and every flag, with its help text,
// type and default. The parser, --help and the README's flag reference all come from it.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace framefit::cli {

enum class FlagType {
  Text,                // any string
  Path,                // an output folder, or a file whose folder is created if missing
  OutputFile,          // an output file, in a folder that must exist
  OutputFileOrFolder,  // as OutputFile, or a folder (existing, or new in an existing one)
  ExistingFile,        // an input file that must exist
  InputPath,           // an input file or folder, checked by the command (a video, images)
  Int,                 // an integer >= min_value
  IntOrAuto,           // "auto" or an integer >= min_value
  Bytes,               // a byte size: 8GiB, 512MiB, 4096
  Fraction,            // a number in [0, 1)
  Device,              // cpu, cuda or cuda:N
  Choice,              // one of `choices`
  Switch,              // present or absent, takes no value
  Repeated,            // given any number of times (--set a=1 --set b=2); Args::list reads them
};

struct Flag {
  std::string name;                   // without dashes: "chunk" for --chunk; unique per command
  std::vector<std::string> commands;  // commands that take it
  FlagType type;
  std::string help;
  std::string default_value;  // empty: no default
  bool required = false;
  std::vector<std::string> choices;  // FlagType::Choice
  int64_t min_value = 0;             // FlagType::Int
};

struct Command {
  std::string name;
  std::string help;
};

const std::vector<Command>& command_table();
const std::vector<Flag>& flag_table();

// A parsed command line: the command and each of its flags' values, defaults filled in. Values
// of the table's numeric types (Int, Bytes, Fraction) are converted once, here; reads of other
// flags as numbers convert their text.
class Args {
 public:
  Args(std::string command, std::map<std::string, std::string> values);
  const std::string& command() const { return command_; }
  bool has(const std::string& flag) const;  // given, or has a default
  std::string text(const std::string& flag) const;
  int64_t integer(const std::string& flag) const;
  double number(const std::string& flag) const;
  double frame_rate(const std::string& flag) const;  // frames per second > 0; 0 when absent
  int64_t bytes(const std::string& flag) const;  // 0 when absent
  bool on(const std::string& flag) const;        // a Switch
  std::vector<std::string> list(const std::string& flag) const;  // a Repeated flag's values
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  std::map<std::string, int64_t> integers_;  // Int and Bytes flags
  std::map<std::string, double> numbers_;    // Fraction flags
};

// The outcome of parsing: args to run, or text to print and an exit code (help, or an error
// that names the flag and what is wrong with it).
struct ParseResult {
  std::optional<Args> args;
  std::string output;  // help text or error message
  int exit_code = 0;
};

ParseResult parse_command_line(const std::vector<std::string>& argv);

}  // namespace framefit::cli
