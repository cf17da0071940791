// What the process's control groups allow it: a container's limits (docker's -m and --cpus,
// Kubernetes' resources.limits), which neither sysconf's physical memory nor the CPU
// affinity mask says. The CPU backend sizes its default KV cache and its thread pool by them.
#pragma once

#include <cstdint>
#include <string>

namespace diffuserve {

struct CgroupLimits {
  int64_t memory_bytes = 0;  // memory.max (v2) or memory.limit_in_bytes (v1); 0: no limit
  double cpus = 0;           // CPU quota over its period (cpu.max, or v1's cfs_quota_us); 0: no limit
};

// The tightest limits of the process's groups and their ancestors, as `proc_self_cgroup` (the
// process's /proc/self/cgroup) names the groups, read under the cgroup mount `root`: v2's
// unified hierarchy, or v1's controllers in root/memory and root/cpu. A group's path there is
// the host's; inside a container the mount shows the container's own group as its root, which
// the walk up the ancestors reaches. Files that are not there or do not parse are skipped.
CgroupLimits cgroup_limits(const std::string& proc_self_cgroup = "/proc/self/cgroup",
                           const std::string& root = "/sys/fs/cgroup");

}  // namespace diffuserve
