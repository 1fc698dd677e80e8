python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
timeout 70 python3 bench/prefill_bench.py --reps 3 --skip linears --record $OUT > $OUT/prefill.txt 2>&1; echo rc $? >> $OUT/prefill.txt
sed -i 's/self.dependent_launch = int(self.info.arch.removeprefix("sm_").rstrip("a")) >= 90/self.dependent_launch = False/' gpu_worker/device/__init__.py
grep -c "self.dependent_launch = False" gpu_worker/device/__init__.py
timeout 70 python3 bench/prefill_bench.py --reps 3 --skip linears --no-torch > $OUT/prefill_nopdl.txt 2>&1; echo rc $? >> $OUT/prefill_nopdl.txt
grep -i "target\|prefill .* tokens\|^ *[a-z_]* .* ms" $OUT/prefill.txt | head -30
echo ==== nopdl
grep -i "prefill .* tokens\|^ *[a-z_]* .* ms" $OUT/prefill_nopdl.txt | head -30
