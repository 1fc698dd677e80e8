python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
python3 -m pytest -q -m gpu tests/gpu/test_fused_kernels.py tests/gpu/test_batching.py tests/gpu/test_kernels.py -k "silu or rmsnorm or sample or qkv or batching or cuda" > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
tail -3 $OUT/tests.txt
timeout 150 python3 bench/batching_bench.py --record $OUT > $OUT/batching.txt 2>&1; echo rc $? >> $OUT/batching.txt
grep "^batch\|target" $OUT/batching.txt | tail -14
timeout 100 python3 bench/decode_bench.py --steps 32 --trials 3 --record $OUT > $OUT/decode.txt 2>&1; echo rc $? >> $OUT/decode.txt
grep "target\|tok" $OUT/decode.txt | tail -10
timeout 80 python3 bench/step_anatomy_bench.py --batches 1,64 --record $OUT > $OUT/anatomy.txt 2>&1; echo rc $? >> $OUT/anatomy.txt
grep -v -i warn $OUT/anatomy.txt | grep -v "^ *$" | head -34
timeout 200 python3 bench/serving_bench.py --concurrency 8,32,64 --trials 2 --requests 1 --arrival-rate 0 --record $OUT > $OUT/serving.txt 2>&1; echo rc $? >> $OUT/serving.txt
grep "target\|ratio" $OUT/serving.txt | tail -12
