#include "batch_data.h"

#include <torch/torch.h>

#include <algorithm>

namespace framefit::train::detail {

std::vector<std::pair<int64_t, int64_t>> BatchData::order(uint64_t seed, int64_t epoch,
                                                          bool shuffle) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t unit : data::epoch_order(units(), seed, epoch, shuffle)) {
    const int64_t n = unit_samples(unit);
    const auto within =
        data::epoch_order(n, seed * 1000003 + static_cast<uint64_t>(unit), epoch, shuffle);
    for (int64_t k : within) out.emplace_back(unit, k);
  }
  return out;
}

int64_t BatchData::largest_unit_bytes() const {
  int64_t largest = 0;
  for (int64_t unit = 0; unit < units(); ++unit) largest = std::max(largest, unit_bytes(unit));
  return largest;
}

std::unique_ptr<BatchData> batch_data(const Config& config, const std::string& split, bool training,
                                      const EventCallback& on_event) {
  if (config.task == "clips") return clip_data(config, split, training, on_event);
  TORCH_CHECK(config.task == "segmentation", "task ", config.task,
              " has no batches of samples: it is trained video by video");
  return image_data(config, split, training);
}

std::unique_ptr<BatchData> batch_data_with_samples(const Config& config, const std::string& split,
                                                   bool training, const EventCallback& on_event) {
  auto data = batch_data(config, split, training, on_event);
  TORCH_CHECK(data->samples() > 0, data->no_samples(split));
  return data;
}

std::string replace_split(std::string path, const std::string& split) {
  const std::string key = "{split}";
  for (auto at = path.find(key); at != std::string::npos; at = path.find(key, at)) {
    path.replace(at, key.size(), split);
  }
  return path;
}

SampleStream::SampleStream(const BatchData& data, std::vector<std::pair<int64_t, int64_t>> order,
                           int64_t position, uint64_t seed, int64_t epoch, int workers,
                           int64_t max_bytes)
    : data_(data), order_(std::move(order)), next_(static_cast<size_t>(position)) {
  std::vector<data::Prefetcher::Job> jobs;
  for (size_t i = next_; i < order_.size(); ++i) {
    const int64_t unit = order_[i].first;
    if (i > next_ && unit == order_[i - 1].first) continue;
    jobs.push_back({[&data, unit, seed, epoch] { return data.load(unit, seed, epoch); },
                    data.unit_bytes(unit)});
  }
  prefetcher_.emplace(std::move(jobs), std::max(1, workers), max_bytes);
}

namespace {
torch::Tensor batch_of(int64_t n, const torch::Tensor& sample) {
  std::vector<int64_t> shape = {n};
  shape.insert(shape.end(), sample.sizes().begin(), sample.sizes().end());
  return torch::empty(shape, sample.options());
}
}  // namespace

SampleStream::Batch SampleStream::next(int64_t n) {
  Batch batch;
  int64_t taken = 0;
  while (taken < n && !done()) {
    const auto [unit, k] = order_[next_];
    if (unit != loaded_unit_) {
      loaded_ = {};
      loaded_unit_ = -1;
      try {
        loaded_ = prefetcher_->next();
        loaded_unit_ = unit;
      } catch (const c10::Error& e) {
        if (!data::skips_error(data_.skip_bad(), e)) throw;
        batch.warnings.push_back(std::string("skipping ") + e.what_without_backtrace());
        ++batch.skipped_units;
        while (!done() && order_[next_].first == unit) ++next_;
        continue;
      }
    }
    const auto [sample, label] = data_.sample(loaded_, unit, k);
    if (taken == 0) {
      batch.samples = batch_of(n, sample);
      batch.labels = batch_of(n, label);
    }
    batch.samples[taken].copy_(sample);
    batch.labels[taken].copy_(label);
    ++taken;
    ++next_;
  }
  if (taken > 0 && taken < n) {
    batch.samples = batch.samples.narrow(0, 0, taken);
    batch.labels = batch.labels.narrow(0, 0, taken);
  }
  return batch;
}

}  // namespace framefit::train::detail
