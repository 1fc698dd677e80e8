python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
python3 -m pytest -q -m gpu tests/gpu/test_kernels.py tests/gpu/test_fused_kernels.py tests/gpu/test_paged_kernels.py -k "rmsnorm or sample" > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
tail -3 $OUT/tests.txt
timeout 300 python3 bench/step_anatomy_bench.py --record $OUT > $OUT/anatomy.txt 2>&1; echo rc $? >> $OUT/anatomy.txt
grep -v -i warn $OUT/anatomy.txt | grep -v "^ *$" | head -60
timeout 240 python3 bench/batching_bench.py --record $OUT > $OUT/batching.txt 2>&1; echo rc $? >> $OUT/batching.txt
grep "^batch\|target" $OUT/batching.txt | tail -16
