python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/gen PYTHONUNBUFFERED=1 GPUPLANE_COMMIT=$(cat .commit)
timeout 400 python3 bench/step_anatomy_bench.py --record $OUT > $OUT/anatomy.txt 2>&1; echo rc $? >> $OUT/anatomy.txt
cat $OUT/anatomy.txt | grep -v Warning | tail -80
