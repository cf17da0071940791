#include "launch.cuh"

#include <cstdlib>
#include <string>

namespace diffuserve::cuda {

bool switched_off(const char* name) {
  const char* value = std::getenv(name);
  return value && std::string(value) == "0";
}

int multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count > 1 ? count : 1;
}

bool wgmma_enabled() {
#ifdef DIFFUSERVE_SM90A
  static const bool on = [] {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return false;
    return major == 9 && minor == 0 && !switched_off("DIFFUSERVE_WGMMA");
  }();
  return on;
#else
  return false;  // no sm_90a code in this build
#endif
}

bool programmatic_launch() {
  static const bool on = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      return false;
    return major >= 9 && !switched_off("DIFFUSERVE_PDL");
  }();
  return on;
}

}  // namespace diffuserve::cuda
