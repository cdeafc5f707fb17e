# Holds XLA's YNNPACK kernels to AVX2 and FMA3, for a capped benchmark process (benchmarks/isa.py starts it as
# `gdb -batch -return-child-result -x benchmarks/ynn_avx2.gdb --args python ...`).
#
# Why: YNNPACK, the library XLA's CPU backend runs most dots and many fusions in, picks its kernels from the CPU's
# own feature bits (cpuinfo), not from XLA's --xla_cpu_max_isa. Under that cap alone, a bf16 x bf16 -> f32 dot on
# an AVX512-BF16 CPU still ran ynn::dot_bf16_bf16_fp32_8x32x2_1x16x2_avx512bf16 (perf, jax 0.10.2). Here the
# first call of ynn::get_supported_arch_flags() stops, and its cached result is set to 0xff before it is computed:
# bits 0-7, the x86 features up to AVX2 and FMA3 that any AVX2 CPU has (YNNPACK's AVX-512, VNNI, BF16 and AMX
# bits are 8 and up); the same dot then ran ynn::dot_bf16_bf16_fp32_4x16x2_1x8x2_avx2_fma3.
# A process that never loads YNNPACK runs to its end at `run`; the commands after it then fail, harmlessly.
set pagination off
set confirm off
set print thread-events off
set print inferior-events off
set breakpoint pending on
break ynn::get_supported_arch_flags
run
set var *(unsigned long *) &'ynn::get_supported_arch_flags()::flags' = 0xff
set var *(unsigned char *) &'guard variable for ynn::get_supported_arch_flags()::flags' = 1
delete
continue
