#include "cgroup.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

namespace diffuserve {

namespace {

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The whole of `text` (less surrounding white space) as an integer.
std::optional<int64_t> parse_int(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<int64_t> read_int(const std::string& path) {
  const auto text = read_text(path);
  return text ? parse_int(*text) : std::nullopt;
}

// "/a/b" -> "/a/b", "/a", "" (the mount's root).
std::vector<std::string> group_and_ancestors(std::string path) {
  while (!path.empty() && path.back() == '/') path.pop_back();
  std::vector<std::string> dirs{path};
  for (auto slash = path.rfind('/'); slash != std::string::npos && !path.empty(); slash = path.rfind('/')) {
    path.resize(slash);
    dirs.push_back(path);
  }
  return dirs;
}

bool has_controller(const std::string& list, const std::string& name) {
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');)
    if (item == name) return true;
  return false;
}

// v1 writes "no limit" as the largest page-aligned int64.
constexpr int64_t kNoMemoryLimit = int64_t(1) << 60;

void take_memory(CgroupLimits& limits, int64_t bytes) {
  if (bytes > 0 && bytes < kNoMemoryLimit)
    limits.memory_bytes = limits.memory_bytes ? std::min(limits.memory_bytes, bytes) : bytes;
}

void take_cpus(CgroupLimits& limits, int64_t quota, int64_t period) {
  if (quota > 0 && period > 0) {
    const double cpus = double(quota) / double(period);
    limits.cpus = limits.cpus > 0 ? std::min(limits.cpus, cpus) : cpus;
  }
}

void read_v2(CgroupLimits& limits, const std::string& dir) {
  if (const auto bytes = read_int(dir + "/memory.max")) take_memory(limits, *bytes);  // ("max": none)
  if (const auto text = read_text(dir + "/cpu.max")) {  // "QUOTA PERIOD", QUOTA "max" for none
    const auto space = text->find(' ');
    if (space != std::string::npos) {
      const auto quota = parse_int(std::string_view(*text).substr(0, space));
      const auto period = parse_int(std::string_view(*text).substr(space + 1));
      if (quota && period) take_cpus(limits, *quota, *period);
    }
  }
}

}  // namespace

CgroupLimits cgroup_limits(const std::string& proc_self_cgroup, const std::string& root) {
  CgroupLimits limits;
  const auto groups = read_text(proc_self_cgroup);
  if (!groups) return limits;
  std::stringstream lines(*groups);
  for (std::string line; std::getline(lines, line);) {  // "ID:CONTROLLERS:PATH"
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string id = line.substr(0, first), controllers = line.substr(first + 1, second - first - 1);
    const auto dirs = group_and_ancestors(line.substr(second + 1));
    if (id == "0" && controllers.empty()) {  // v2's unified hierarchy
      for (const auto& dir : dirs) read_v2(limits, root + dir);
      continue;
    }
    if (has_controller(controllers, "memory"))
      for (const auto& dir : dirs)
        if (const auto bytes = read_int(root + "/memory" + dir + "/memory.limit_in_bytes")) take_memory(limits, *bytes);
    if (has_controller(controllers, "cpu"))
      for (const std::string mount : {"/cpu", "/cpu,cpuacct"})
        for (const auto& dir : dirs) {
          const auto quota = read_int(root + mount + dir + "/cpu.cfs_quota_us");  // -1: none
          const auto period = read_int(root + mount + dir + "/cpu.cfs_period_us");
          if (quota && period) take_cpus(limits, *quota, *period);
        }
  }
  return limits;
}

}  // namespace diffuserve
