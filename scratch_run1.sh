set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
python3 -m pytest -q -x -m gpu tests/gpu/test_int4_batched.py tests/gpu/test_paged_kernels.py tests/gpu/test_batching.py > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
tail -5 $OUT/tests.txt
python3 bench/int4_batched_bench.py --reps 10 --trials 3 --record $OUT > $OUT/int4_pdl.txt 2>&1; echo rc $? >> $OUT/int4_pdl.txt
python3 bench/int4_batched_bench.py --reps 10 --trials 3 --no-pdl > $OUT/int4_nopdl.txt 2>&1; echo rc $? >> $OUT/int4_nopdl.txt
sed -i 's/#define GP_PREFETCH_L2 1/#define GP_PREFETCH_L2 0/' gpu_worker/kernels/cu/int4_batched.cu
python3 bench/int4_batched_bench.py --reps 10 --trials 3 > $OUT/int4_pdl_noprefetch.txt 2>&1; echo rc $? >> $OUT/int4_pdl_noprefetch.txt
sed -i 's/#define GP_PREFETCH_L2 0/#define GP_PREFETCH_L2 1/' gpu_worker/kernels/cu/int4_batched.cu
for f in int4_pdl int4_nopdl int4_pdl_noprefetch; do echo "== $f"; grep -A8 "decode step's linears (32" $OUT/$f.txt | head -8; grep -E "^ +(qkv|wo|gate_up|w_down|lm_head)" $OUT/$f.txt; done
