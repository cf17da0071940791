"""The build's switches and what an installed package holds: the CMake options' values, the
installed library's copies and search path, and the C++ package's directories."""
import os
import re
import shutil
import subprocess

import pytest

import diffuserve as ds

SOURCE = os.path.join(os.path.dirname(__file__), "..")


def configure(tmp_path, *options, env=None):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    return subprocess.run([cmake, "-S", SOURCE, "-B", str(tmp_path / "build"), *options], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("value", ["off", "Off", "0", "false", "NO"])
def test_a_switch_takes_any_case_and_cmakes_booleans(tmp_path, value):
    """-DDIFFUSERVE_CUDA=off (any case, or a CMake boolean) turns the backend off; it had been
    compared with STREQUAL "OFF", so a lowercase off or a 0 built it as AUTO does."""
    done = configure(tmp_path, f"-DDIFFUSERVE_CUDA={value}")
    assert done.returncode == 0, done.stderr
    assert f"diffuserve: CUDA backend OFF (DIFFUSERVE_CUDA={value})" in done.stdout


def test_an_unknown_switch_value_is_an_error(tmp_path):
    done = configure(tmp_path, "-DDIFFUSERVE_CUDA=maybe")
    assert done.returncode != 0
    assert "DIFFUSERVE_CUDA=maybe: expected AUTO, ON or OFF" in done.stderr


def without_nvcc_on_path() -> str:
    return ":".join(d for d in os.environ["PATH"].split(":") if d and not os.path.exists(os.path.join(d, "nvcc")))


def test_nvcc_off_path_is_found_under_cuda_home(tmp_path):
    """A toolkit off PATH is found where CUDA_HOME says (the build had gone CPU-only); one there
    that cannot build leaves the backend off, as one on PATH does (not a failed configure)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH")}
    done = configure(tmp_path, env={**env, "PATH": without_nvcc_on_path(),
                                    "CUDA_HOME": os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))})
    assert done.returncode == 0 and "diffuserve: CUDA backend ON" in done.stdout, done.stdout + done.stderr
    broken = tmp_path / "broken"
    (broken / "bin").mkdir(parents=True)
    (broken / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (broken / "bin" / "nvcc").chmod(0o755)
    shutil.rmtree(tmp_path / "build")
    done = configure(tmp_path, env={**env, "PATH": without_nvcc_on_path(), "CUDA_HOME": str(broken)})
    assert done.returncode == 0 and "diffuserve: CUDA backend OFF (no CUDA compiler found" in done.stdout, \
        done.stdout + done.stderr


def test_a_cuda_build_without_a_compiler_says_where_one_is_looked_for(tmp_path):
    """ON without nvcc anywhere it is looked for fails, naming the ways to give one."""
    env = {**os.environ, "PATH": os.path.dirname(shutil.which("cmake") or "/usr/bin") + ":/usr/bin:/bin",
           "CUDA_HOME": str(tmp_path / "none"), "CUDA_PATH": str(tmp_path / "none")}
    env.pop("CUDACXX", None)
    if os.path.exists("/usr/local/cuda/bin/nvcc") or any(
            os.path.exists(os.path.join(d, "nvcc")) for d in env["PATH"].split(":")):
        pytest.skip("nvcc is where the build looks for it")
    done = configure(tmp_path, "-DDIFFUSERVE_CUDA=ON", env=env)
    assert done.returncode != 0
    assert "no CUDA compiler was found (put nvcc on PATH, or set CUDACXX" in done.stderr


def installed_library():
    lib = os.path.dirname(os.path.dirname(ds.cmake_dir()))  # .../diffuserve/lib
    return lib, sorted(name for name in os.listdir(lib) if name.startswith("libdiffuserve"))


def test_the_package_holds_the_library_once():
    """A wheel holds no symbolic links: the versioned sonames had put three copies of the
    library in it (12 MB each with the CUDA backend)."""
    assert installed_library()[1] == ["libdiffuserve.so"]


def test_a_wheels_cublaslt_is_found_beside_it():
    """A library linked to the nvidia-cublas wheel's cuBLASLt looks for it in the environment it
    is installed into ($ORIGIN/../../nvidia/...), not only at the build's path (a wheel built in
    one environment had failed to import in any other)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    lib, names = installed_library()
    dynamic = subprocess.run([readelf, "-d", os.path.join(lib, names[0])], capture_output=True, text=True,
                             check=True).stdout
    if "libcublasLt" not in dynamic:
        pytest.skip("this build has no cuBLASLt")
    runpath = next(line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "RUNPATH" in line)
    wheel_paths = [p for p in runpath.split(":") if "/nvidia/" in p and not p.startswith("$ORIGIN")]
    for path in wheel_paths:
        assert "$ORIGIN/../../nvidia/" + path.split("/nvidia/", 1)[1] in runpath.split(":"), runpath


def test_the_cpp_package_is_found_from_the_extensions_directory(monkeypatch, tmp_path):
    """cmake_dir() and include_dir() look where the extension was installed, wherever the Python
    files are (an editable install keeps those in the source tree, where they had looked, and failed)."""
    monkeypatch.setattr(ds, "_HERE", tmp_path)  # the Python files' directory, as an editable install has it
    assert os.path.isfile(os.path.join(ds.cmake_dir(), "diffuserveConfig.cmake"))
    assert os.path.isfile(os.path.join(ds.include_dir(), "diffuserve", "diffuserve.h"))
    assert os.path.dirname(os.path.dirname(ds.cmake_dir())).startswith(os.path.dirname(ds._core.__file__))


def test_the_version_is_the_same_in_every_place_that_states_it():
    """pyproject.toml (the wheel's), CMakeLists.txt's project() (the C++ package's) and
    diffuserve.__version__ are written by hand: a release that bumps one must bump all."""
    def found(path, pattern):
        with open(os.path.join(SOURCE, path)) as f:
            return re.search(pattern, f.read(), re.M).group(1)
    assert found("pyproject.toml", r'^version = "([^"]+)"') == found("CMakeLists.txt", r"project\(diffuserve VERSION (\S+)") \
        == ds.__version__
