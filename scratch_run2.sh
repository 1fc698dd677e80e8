python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
python3 bench/int4_batched_bench.py --reps 10 --trials 3 --record $OUT > $OUT/int4.txt 2>&1; echo rc $? >> $OUT/int4.txt
grep -A7 "decode step's linears (32" $OUT/int4.txt
python3 bench/decode_attention_bench.py --reps 10 --trials 3 --record $OUT > $OUT/attn.txt 2>&1; echo rc $? >> $OUT/attn.txt
python3 bench/decode_attention_bench.py --reps 10 --trials 3 --no-pdl > $OUT/attn_nopdl.txt 2>&1; echo rc $? >> $OUT/attn_nopdl.txt
python3 bench/batching_bench.py --record $OUT > $OUT/batching.txt 2>&1; echo rc $? >> $OUT/batching.txt
GPUPLANE_DEPENDENT_LAUNCH=0 python3 bench/batching_bench.py --no-torch > $OUT/batching_nopdl.txt 2>&1; echo rc $? >> $OUT/batching_nopdl.txt
tail -4 $OUT/attn.txt $OUT/attn_nopdl.txt
grep -i "device\|tok/s\|ratio\|MISSED" $OUT/batching.txt | tail -30
grep -i "device\|tok/s" $OUT/batching_nopdl.txt | tail -16
