#include "framefit/models/weights.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>
#if FRAMEFIT_WITH_LIBZIP
#include <zip.h>
#endif

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

namespace framefit::models {

namespace {

// ---------------------------------------------------------------------------------------------
// A reader for the pickle inside torch.save's zip archive, limited to what state_dicts and
// checkpoints contain. LibTorch's own unpickler maps collections.OrderedDict to None (it only
// expects it as a tensor's empty hook dict), which makes every OrderedDict state_dict
// unreadable; storages and the zip container are still read with LibTorch's classes.

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind { None, Bool, Int, Float, String, Tuple, List, Dict, Tensor, Global, DType };
  Kind kind = Kind::None;
  int64_t integer = 0;
  double real = 0;
  std::string text;  // String; Global: "module.name"
  std::vector<ValuePtr> items;                          // Tuple, List
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // Dict, in insertion order
  torch::Tensor tensor;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

const std::map<std::string, c10::ScalarType>& storage_types() {
  static const std::map<std::string, c10::ScalarType> types = {
      {"FloatStorage", torch::kFloat32},   {"DoubleStorage", torch::kFloat64},
      {"HalfStorage", torch::kFloat16},    {"BFloat16Storage", torch::kBFloat16},
      {"LongStorage", torch::kInt64},      {"IntStorage", torch::kInt32},
      {"ShortStorage", torch::kInt16},     {"CharStorage", torch::kInt8},
      {"ByteStorage", torch::kUInt8},      {"BoolStorage", torch::kBool},
      {"ComplexFloatStorage", torch::kComplexFloat},
      {"ComplexDoubleStorage", torch::kComplexDouble}};
  return types;
}

class StateUnpickler {
 public:
  StateUnpickler(caffe2::serialize::PyTorchStreamReader& archive, std::string path)
      : archive_(archive), path_(std::move(path)) {}

  ValuePtr run() {
    auto [data, size] = archive_.getRecord("data.pkl");
    bytes_ = static_cast<const uint8_t*>(data.get());
    size_ = size;
    holder_ = std::move(data);
    while (true) {
      const uint8_t op = read_u8();
      if (op == '.') break;
      step(op);
    }
    TORCH_CHECK(stack_.size() == 1, bad("the pickle left ", stack_.size(), " values"));
    return stack_.back();
  }

 private:
  template <typename... Args>
  std::string bad(const Args&... args) const {
    return c10::str("cannot read '", path_, "': ", args...,
                    " at byte ", pos_, " of data.pkl. Is it a torch.save file of a state_dict?");
  }

  uint8_t read_u8() {
    TORCH_CHECK(pos_ < size_, bad("unexpected end of the pickle"));
    return bytes_[pos_++];
  }
  const uint8_t* read_bytes(size_t n) {
    TORCH_CHECK(n <= size_ - pos_, bad("unexpected end of the pickle"));
    const uint8_t* p = bytes_ + pos_;
    pos_ += n;
    return p;
  }
  uint64_t read_le(size_t n) {
    const uint8_t* p = read_bytes(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t(p[i]) << (8 * i);
    return v;
  }
  std::string read_line() {
    std::string s;
    for (uint8_t c = read_u8(); c != '\n'; c = read_u8()) s.push_back(static_cast<char>(c));
    return s;
  }
  std::string read_string(size_t n) {
    const uint8_t* p = read_bytes(n);
    return std::string(reinterpret_cast<const char*>(p), n);
  }

  ValuePtr pop() {
    TORCH_CHECK(!stack_.empty(), bad("stack underflow"));
    auto v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::vector<ValuePtr> pop_to_mark() {
    TORCH_CHECK(!marks_.empty(), bad("no MARK"));
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }
  void push_int(int64_t v) {
    auto value = make(Value::Kind::Int);
    value->integer = v;
    stack_.push_back(value);
  }
  void push_string(std::string s) {
    auto value = make(Value::Kind::String);
    value->text = std::move(s);
    stack_.push_back(value);
  }
  void push_tuple(std::vector<ValuePtr> items) {
    auto value = make(Value::Kind::Tuple);
    value->items = std::move(items);
    stack_.push_back(value);
  }
  void push_global(const std::string& module, const std::string& name) {
    if (module == "torch" && storage_types().count(name)) {
      auto value = make(Value::Kind::DType);
      value->dtype = storage_types().at(name);
      stack_.push_back(value);
      return;
    }
    auto value = make(Value::Kind::Global);
    value->text = module + "." + name;
    stack_.push_back(value);
  }
  void memo_put(size_t index) {
    TORCH_CHECK(!stack_.empty(), bad("memoize on an empty stack"));
    memo_[index] = stack_.back();
  }
  void memo_get(size_t index) {
    auto it = memo_.find(index);
    TORCH_CHECK(it != memo_.end(), bad("memo entry ", index, " missing"));
    stack_.push_back(it->second);
  }

  static std::vector<int64_t> int_list(const ValuePtr& v) {
    std::vector<int64_t> out;
    for (const auto& item : v->items) out.push_back(item->integer);
    return out;
  }

  torch::Tensor load_storage(const Value& pid) {
    TORCH_CHECK(pid.kind == Value::Kind::Tuple && pid.items.size() >= 5 &&
                    pid.items[0]->text == "storage" && pid.items[1]->kind == Value::Kind::DType,
                bad("unsupported persistent id (not a tensor storage)"));
    const std::string key = pid.items[2]->text;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    const auto dtype = pid.items[1]->dtype;
    const int64_t numel = pid.items[4]->integer;
    auto storage = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
    if (numel > 0) {
      auto [data, size] = archive_.getRecord("data/" + key);
      TORCH_CHECK(size == static_cast<size_t>(storage.nbytes()),
                  bad("storage ", key, " has ", size, " bytes, expected ", storage.nbytes()));
      std::memcpy(storage.data_ptr(), data.get(), size);
    }
    storages_[key] = storage;
    return storage;
  }

  ValuePtr call(const ValuePtr& callable, const ValuePtr& args) {
    TORCH_CHECK(callable->kind == Value::Kind::Global, bad("call of a non-global"));
    const std::string& f = callable->text;
    if (f == "collections.OrderedDict" || f == "builtins.dict") return make(Value::Kind::Dict);
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor") {
      TORCH_CHECK(args->items.size() >= 4, bad("_rebuild_tensor with too few arguments"));
      auto result = make(Value::Kind::Tensor);
      result->tensor = args->items[0]->tensor.as_strided(
          int_list(args->items[2]), int_list(args->items[3]), args->items[1]->integer);
      return result;
    }
    if (f == "torch._utils._rebuild_parameter" ||
        f == "torch._utils._rebuild_parameter_with_state") {
      auto result = make(Value::Kind::Tensor);
      result->tensor = args->items.at(0)->tensor;
      return result;
    }
    if (f == "torch.jit._pickle.restore_type_tag" || f == "torch.jit._pickle.build_intlist" ||
        f == "torch.jit._pickle.build_tensorlist" || f == "torch.jit._pickle.build_doublelist" ||
        f == "torch.jit._pickle.build_boollist") {
      // LibTorch's pickle_save wraps typed containers: (value, type string) or (list,).
      return args->items.at(0);
    }
    if (f == "torch._tensor._rebuild_from_type_v2") {
      // (function, type, args, state): a tensor subclass; rebuild the plain tensor.
      return call(args->items.at(0), args->items.at(2));
    }
    TORCH_CHECK(false, bad("unsupported Python object ", f,
                           " (only tensors, dicts, lists and plain values are read)"));
  }

  void step(uint8_t op) {
    switch (op) {
      case 0x80: read_u8(); break;        // PROTO
      case 0x95: read_le(8); break;       // FRAME
      case '(': marks_.push_back(stack_.size()); break;
      case '}': stack_.push_back(make(Value::Kind::Dict)); break;
      case ']': stack_.push_back(make(Value::Kind::List)); break;
      case ')': push_tuple({}); break;
      case 't': push_tuple(pop_to_mark()); break;
      case 0x85: { auto a = pop(); push_tuple({a}); break; }
      case 0x86: { auto b = pop(); auto a = pop(); push_tuple({a, b}); break; }
      case 0x87: { auto c = pop(); auto b = pop(); auto a = pop(); push_tuple({a, b, c}); break; }
      case 'N': stack_.push_back(make(Value::Kind::None)); break;
      case 0x88: case 0x89: {
        auto v = make(Value::Kind::Bool);
        v->integer = op == 0x88;
        stack_.push_back(v);
        break;
      }
      case 'K': push_int(static_cast<int64_t>(read_le(1))); break;
      case 'M': push_int(static_cast<int64_t>(read_le(2))); break;
      case 'J': push_int(static_cast<int32_t>(read_le(4))); break;
      case 0x8a: {  // LONG1: little-endian two's complement
        const size_t n = read_u8();
        TORCH_CHECK(n <= 8, bad("integer too large"));
        uint64_t v = read_le(n);
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t(0) << (8 * n);
        push_int(static_cast<int64_t>(v));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian double
        const uint8_t* p = read_bytes(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
        auto v = make(Value::Kind::Float);
        std::memcpy(&v->real, &bits, 8);
        stack_.push_back(v);
        break;
      }
      case 'X': push_string(read_string(read_le(4))); break;
      case 0x8c: push_string(read_string(read_le(1))); break;
      case 0x8d: push_string(read_string(read_le(8))); break;
      case 'U': case 'C': push_string(read_string(read_le(1))); break;
      case 'T': case 'B': push_string(read_string(read_le(4))); break;
      case 'c': {
        const auto module = read_line();
        const auto name = read_line();
        push_global(module, name);
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const auto name = pop()->text;
        const auto module = pop()->text;
        push_global(module, name);
        break;
      }
      case 'q': memo_put(read_le(1)); break;
      case 'r': memo_put(read_le(4)); break;
      case 0x94: memo_put(memo_.size()); break;
      case 'h': memo_get(read_le(1)); break;
      case 'j': memo_get(read_le(4)); break;
      case 'Q': {
        auto pid = pop();
        auto v = make(Value::Kind::Tensor);
        v->tensor = load_storage(*pid);
        stack_.push_back(v);
        break;
      }
      case 'R': case 0x81: {  // REDUCE, NEWOBJ
        auto args = pop();
        auto callable = pop();
        stack_.push_back(call(callable, args));
        break;
      }
      case 'b': pop(); break;  // BUILD: instance state (an OrderedDict's _metadata) is not needed
      case 's': {
        auto value = pop();
        auto key = pop();
        TORCH_CHECK(!stack_.empty() && stack_.back()->kind == Value::Kind::Dict,
                    bad("SETITEM on a non-dict"));
        stack_.back()->entries.emplace_back(key, value);
        break;
      }
      case 'u': {
        auto items = pop_to_mark();
        TORCH_CHECK(items.size() % 2 == 0 && !stack_.empty() &&
                        stack_.back()->kind == Value::Kind::Dict,
                    bad("SETITEMS on a non-dict"));
        for (size_t i = 0; i < items.size(); i += 2) {
          stack_.back()->entries.emplace_back(items[i], items[i + 1]);
        }
        break;
      }
      case 'a': {
        auto value = pop();
        TORCH_CHECK(!stack_.empty(), bad("APPEND on an empty stack"));
        stack_.back()->items.push_back(value);
        break;
      }
      case 'e': {
        auto items = pop_to_mark();
        TORCH_CHECK(!stack_.empty(), bad("APPENDS on an empty stack"));
        for (auto& item : items) stack_.back()->items.push_back(item);
        break;
      }
      default:
        TORCH_CHECK(false, bad("unsupported pickle opcode 0x", std::hex, int(op)));
    }
  }

  caffe2::serialize::PyTorchStreamReader& archive_;
  std::string path_;
  at::DataPtr holder_;
  const uint8_t* bytes_ = nullptr;
  size_t size_ = 0;
  size_t pos_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::map<size_t, ValuePtr> memo_;
  std::map<std::string, torch::Tensor> storages_;
};

// The tensors of a dict, or of the dict under a checkpoint's "state_dict" / "model" key.
StateDict to_state_dict(const Value& root, const std::string& path) {
  TORCH_CHECK(root.kind == Value::Kind::Dict, "'", path,
              "' holds no dict: expected torch.save(model.state_dict(), path)");
  bool all_tensors = true;
  std::vector<std::string> keys;
  for (const auto& [key, value] : root.entries) {
    keys.push_back(key->text);
    all_tensors = all_tensors && value->kind == Value::Kind::Tensor;
  }
  if (!all_tensors) {
    for (const char* wrapper : {"state_dict", "model", "model_state_dict"}) {
      for (const auto& [key, value] : root.entries) {
        if (key->text == wrapper && value->kind == Value::Kind::Dict) {
          return to_state_dict(*value, path + ":" + wrapper);
        }
      }
    }
    std::ostringstream listing;
    for (size_t i = 0; i < keys.size() && i < 8; ++i) listing << (i ? ", " : "") << keys[i];
    TORCH_CHECK(false, "'", path, "' is a dict with non-tensor values and no 'state_dict' or "
                "'model' entry; its keys: ", listing.str());
  }
  StateDict state;
  for (const auto& [key, value] : root.entries) {
    TORCH_CHECK(key->kind == Value::Kind::String, "'", path, "' has a non-string key");
    state.emplace_back(key->text, value->tensor);
  }
  return state;
}

void collect(const torch::nn::Module& module, const std::string& prefix, StateDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (p.value().defined()) out.emplace_back(prefix + p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value());
  }
  for (const auto& child : module.named_children()) {
    collect(*child.value(), prefix + child.key() + ".", out);
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  return c10::str(c10::IntArrayRef(shape));
}

}  // namespace

namespace {
ValuePtr unpickle_file(const std::string& path) {
  TORCH_CHECK(std::ifstream(path).good(), "file '", path, "' does not exist or cannot be read");
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", path, "' is not a torch.save zip archive (", e.what_without_backtrace(),
                "). Save weights with torch.save(model.state_dict(), path) from PyTorch >= 1.6.");
  }
  check_archive(path, "'" + path + "'");
  TORCH_CHECK(archive->hasRecord("data.pkl"), "'", path, "' is a zip archive without data.pkl: "
              "a TorchScript module? Save its state_dict() with torch.save instead.");
  StateUnpickler unpickler(*archive, path);
  return unpickler.run();
}

void write_atomically(const std::vector<char>& bytes, const std::string& path) {
  write_file_atomically(path, [&](const ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}
}  // namespace

void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink& sink)>& produce) {
  const std::string temp = path + ".tmp";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "cannot write '", temp, "': ", std::strerror(errno));
  int error = 0;  // the first write's error; the bytes after it are dropped
  const ByteSink sink = [&](const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0 && error == 0) {
      const ssize_t n = ::write(fd, bytes, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error = n < 0 ? errno : EIO;
        break;
      }
      bytes += n;
      size -= static_cast<size_t>(n);
    }
  };
  try {
    produce(sink);
  } catch (...) {
    ::close(fd);
    std::remove(temp.c_str());
    throw;
  }
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error != 0) {
    std::remove(temp.c_str());
    TORCH_CHECK(false, "writing '", path, "' failed: ", std::strerror(error),
                " (nothing was written: an earlier file of that name is as it was)");
  }
  TORCH_CHECK(std::rename(temp.c_str(), path.c_str()) == 0, "cannot rename '", temp, "' to '",
              path, "': ", std::strerror(errno));
  const auto slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : path.substr(0, slash);
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);  // the rename itself
    ::close(dir);
  }
}

void check_archive(const std::string& path, const std::string& what) {
#if !FRAMEFIT_WITH_LIBZIP
  (void)path;
  (void)what;
#else
  {
    char magic[4] = {};
    std::ifstream(path, std::ios::binary).read(magic, sizeof magic);
    if (std::memcmp(magic, "PK\x03\x04", sizeof magic) != 0) return;
  }
  int code = 0;
  std::unique_ptr<zip_t, decltype(&zip_discard)> archive(zip_open(path.c_str(), ZIP_RDONLY, &code),
                                                         &zip_discard);
  if (!archive) {
    zip_error_t error;
    zip_error_init_with_code(&error, code);
    const std::string text = zip_error_strerror(&error);
    zip_error_fini(&error);
    TORCH_CHECK(false, what, " is damaged: ", text);
  }
  std::vector<char> buffer(1 << 20);
  const zip_int64_t entries = zip_get_num_entries(archive.get(), 0);
  for (zip_int64_t i = 0; i < entries; ++i) {
    const char* name = zip_get_name(archive.get(), i, 0);
    const std::string entry = name ? name : "#" + std::to_string(i);
    std::unique_ptr<zip_file_t, decltype(&zip_fclose)> file(zip_fopen_index(archive.get(), i, 0),
                                                            &zip_fclose);
    TORCH_CHECK(file, what, " is damaged: its entry ", entry, ": ", zip_strerror(archive.get()));
    // Reading to the end is what compares the CRC-32.
    zip_int64_t n = 0;
    while ((n = zip_fread(file.get(), buffer.data(), buffer.size())) > 0) {
    }
    TORCH_CHECK(n == 0, what, " is damaged: its entry ", entry, ": ",
                zip_file_strerror(file.get()));
  }
#endif
}

StateDict read_state_dict(const std::string& path) {
  return to_state_dict(*unpickle_file(path), path);
}

torch::Tensor read_tensor(const std::string& path) {
  auto value = unpickle_file(path);
  TORCH_CHECK(value->kind == Value::Kind::Tensor, "'", path, "' holds no tensor: expected a file "
              "written by torch.save(tensor, path)");
  return value->tensor;
}

void write_tensor(const torch::Tensor& tensor, const std::string& path) {
  write_atomically(torch::pickle_save(c10::IValue(tensor.detach().to(torch::kCPU).contiguous())),
                   path);
}

void write_state_dict(const StateDict& state, const std::string& path) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, tensor] : state) {
    TORCH_CHECK(!dict.contains(name), "state_dict has the key '", name, "' twice");
    dict.insert(name, tensor.detach().to(torch::kCPU).contiguous());
  }
  write_atomically(torch::pickle_save(c10::IValue(dict)), path);
}

StateDict state_dict(const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", out);
  for (auto& entry : out) entry.second = entry.second.detach();
  return out;
}

std::string LoadReport::describe(size_t limit) const {
  std::ostringstream out;
  const auto more = [&](size_t count, const char* what) {
    if (count > limit) out << "... and " << count - limit << " more " << what << "\n";
  };
  for (size_t i = 0; i < missing.size() && i < limit; ++i)
    out << "missing key (in the model, not in the file): " << missing[i] << "\n";
  more(missing.size(), "missing keys");
  for (size_t i = 0; i < unexpected.size() && i < limit; ++i)
    out << "unexpected key (in the file, not in the model): " << unexpected[i] << "\n";
  more(unexpected.size(), "unexpected keys");
  for (size_t i = 0; i < mismatched.size() && i < limit; ++i) {
    const auto& m = mismatched[i];
    out << "shape mismatch for " << m.name << ": the model has " << shape_str(m.expected)
        << ", the file " << shape_str(m.got) << "\n";
  }
  more(mismatched.size(), "shape mismatches");
  return out.str();
}

namespace {

bool is_batch_counter(const std::string& name) {
  static const std::string counter = "num_batches_tracked";
  return name.size() >= counter.size() &&
         name.compare(name.size() - counter.size(), counter.size(), counter) == 0;
}

// The prefix P under which `state` holds every name of `needed` (as P + name): "" when the
// names are there as they are or no prefix holds them all; several such prefixes are an error.
std::string find_key_prefix(const std::set<std::string>& needed, const StateDict& state) {
  std::set<std::string> plain;
  for (const auto& entry : state) plain.insert(entry.first);
  if (std::includes(plain.begin(), plain.end(), needed.begin(), needed.end())) return "";
  std::map<std::string, std::set<std::string>> found;  // prefix -> needed names under it
  for (const auto& [key, tensor] : state) {
    for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', dot + 1)) {
      const auto rest = key.substr(dot + 1);
      if (needed.count(rest)) found[key.substr(0, dot + 1)].insert(rest);
    }
  }
  std::vector<std::string> complete;
  for (const auto& [prefix, names] : found) {
    if (names.size() == needed.size()) complete.push_back(prefix);
  }
  TORCH_CHECK(complete.size() <= 1, "the file holds the model's weights under ", complete.size(),
              " prefixes (", c10::Join(", ", complete), "): choose one");
  return complete.empty() ? "" : complete.front();
}

}  // namespace

LoadReport load_state_dict(torch::nn::Module& module, const StateDict& state,
                           const LoadOptions& options) {
  StateDict targets;
  collect(module, "", targets);
  std::map<std::string, torch::Tensor> by_name(targets.begin(), targets.end());
  auto ignored = [&](const std::string& name) {
    for (const auto& prefix : options.ignore_prefixes) {
      if (name.rfind(prefix, 0) == 0) return true;
    }
    return false;
  };

  std::string prefix = options.prefix;
  if (prefix.empty() && options.find_prefix) {
    std::set<std::string> needed;
    for (const auto& [name, tensor] : targets) {
      if (!is_batch_counter(name) && !ignored(name)) needed.insert(name);
    }
    prefix = find_key_prefix(needed, state);
  }
  StateDict selected;
  for (const auto& [name, tensor] : state) {
    if (name.rfind(prefix, 0) == 0) selected.emplace_back(name.substr(prefix.size()), tensor);
  }
  TORCH_CHECK(!selected.empty(), "no key of the file starts with \"", prefix, "\"");

  LoadReport report;
  report.prefix = prefix;
  std::map<std::string, bool> seen;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  for (const auto& [name, tensor] : selected) {
    if (ignored(name)) continue;
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      report.unexpected.push_back(name);
      continue;
    }
    seen[name] = true;
    if (it->second.sizes() != tensor.sizes()) {
      report.mismatched.push_back({name, it->second.sizes().vec(), tensor.sizes().vec()});
      continue;
    }
    report.loaded.push_back(name);
    copies.emplace_back(it->second, tensor);
  }
  for (const auto& [name, tensor] : targets) {
    // Like PyTorch's BatchNorm, files without num_batches_tracked (older torchvision weights)
    // are complete: the counter keeps its value.
    if (!seen.count(name) && !is_batch_counter(name)) report.missing.push_back(name);
  }
  TORCH_CHECK(!options.strict || report.complete(), "state_dict does not match the model",
              prefix.empty() ? std::string() : " (keys taken from under \"" + prefix + "\")",
              "; nothing was loaded:\n", report.describe());
  torch::NoGradGuard no_grad;
  for (auto& [target, source] : copies) target.copy_(source);
  return report;
}

}  // namespace framefit::models
