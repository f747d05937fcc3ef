"""Test-only build checks of the FA-V100 CUDA source (no GPU needed): ``nvcc -c`` of the kernel file alone, and the
sm_70 device-code build with CUDA 12's NVRTC + ptxas wheels (CUDA 13's nvcc no longer targets sm_70)."""

import os
from typing import Union

from diffusers_h3.kernels.attention.fa_v100 import KERNEL_SOURCE


def compile_kernel_source(output: Union[str, os.PathLike], arch: str, *, nvcc: str = "nvcc", timeout: float = 300.0):
    """Compile ``csrc/fa_v100.cu`` alone (no torch headers) to an object file with ``nvcc -c -arch=sm_<arch>``.

    Checks that the kernel compiles on machines without a GPU (and a CUDA 12 toolkit's sm_70 build). Returns ptxas'
    resource report (registers, spills) as text; raises ``RuntimeError`` with the compiler output on failure.
    """
    import subprocess

    command = [nvcc, "-c", "-O3", "--use_fast_math", f"-arch=sm_{arch}", "-Xptxas", "-v"]
    command += [str(KERNEL_SOURCE), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def compile_device_code_sm70(workdir: Union[str, os.PathLike], *, arch: str = "70", timeout: float = 300.0) -> str:
    """Compile the kernel's device code for ``sm_<arch>`` with CUDA 12's NVRTC and ptxas, without a GPU or nvcc.

    CUDA 13's nvcc no longer targets sm_70, so CPU CI checks the V100 build this way: ``pip install
    "diffusers-h3[sm70-check]"`` brings NVRTC, ptxas and the CUDA headers of CUDA 12 as wheels. Under NVRTC the file
    compiles its device code only (the host launchers are standard CUDA runtime code). Returns ptxas' resource report
    (registers, spills) for the four variants; raises ``RuntimeError`` with the compiler log on failure.
    """
    import ctypes
    import importlib.util
    import subprocess

    def package_dir(name: str) -> str:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                f"{name} is not installed: the sm_70 check needs CUDA 12's NVRTC, ptxas and headers "
                '(pip install "diffusers-h3[sm70-check]").'
            )
        return list(spec.submodule_search_locations)[0]

    nvrtc_dir, nvcc_dir, runtime_dir = (
        package_dir(f"nvidia.{name}") for name in ("cuda_nvrtc", "cuda_nvcc", "cuda_runtime")
    )
    nvrtc = ctypes.CDLL(os.path.join(nvrtc_dir, "lib", "libnvrtc.so.12"))
    source = KERNEL_SOURCE.read_text()
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"fa_v100.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        for head_dim in (64, 128):
            for query_tile in (64, 128):
                nvrtc.nvrtcAddNameExpression(program, f"&fa_v100_forward_kernel<{head_dim}, {query_tile}>".encode())
        options = [
            f"--gpu-architecture=compute_{arch}",
            f"-I{os.path.join(runtime_dir, 'include')}",
            f"-I{os.path.join(nvcc_dir, 'include')}",
            "-std=c++17",
            "--use_fast_math",
        ]
        encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = nvrtc.nvrtcCompileProgram(program, len(options), encoded)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        if status != 0:
            raise RuntimeError(f"NVRTC (CUDA 12) failed to compile fa_v100.cu for compute_{arch}:\n{log.value.decode()}")
        nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(program, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    ptx_path = os.path.join(os.fspath(workdir), f"fa_v100_sm{arch}.ptx")
    with open(ptx_path, "wb") as handle:
        handle.write(ptx.value)
    command = [os.path.join(nvcc_dir, "bin", "ptxas"), f"-arch=sm_{arch}", "-v", ptx_path, "-o", ptx_path[:-4] + ".cubin"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr
