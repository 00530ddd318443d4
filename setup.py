"""The one native part of qkv: the block products (src/qkv/kernels/q4.c), the float32 product of a decoding step
(f32.c) and its fused operations (ops.c), one C library that qkv loads through ctypes (no PyTorch headers, so one
build serves any torch), which is also a small Python module (calls.c) through which a decoding step makes its
frequent calls without ctypes' cost. It is optional: where no C compiler works, the install goes on and qkv
multiplies with PyTorch's int4 kernel and runs its layers as written in Python, saying so once (qkv.kernels)."""

from setuptools import Extension, setup

# -fopenmp when compiling only: the library is not linked to an OpenMP runtime and runs on the one PyTorch loads.
# -ffp-contract=off: the portable variant's float arithmetic as written, the reference the others are held to.
KERNEL = Extension("qkv.kernels._q4", sources=["src/qkv/kernels/q4.c", "src/qkv/kernels/ops.c",
                                                    "src/qkv/kernels/f32.c", "src/qkv/kernels/calls.c"], optional=True,
                   depends=["src/qkv/kernels/kernels.h"],
                   extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"])

setup(ext_modules=[KERNEL])
