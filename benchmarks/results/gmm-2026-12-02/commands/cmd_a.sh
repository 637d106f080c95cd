# gmm check, then k3-small B8 step: base checkout (c1b4145) and this checkout, one lease
source benchmarks/gpu_env.sh
timeout 170 python3 benchmarks/gmm_check.py --json $OUT/gmm_check.json > $OUT/gmm_check.log 2>&1
echo "check rc $?" >> $OUT/summary.txt
for who in base new; do
  if [ $who = base ]; then dir=.device/base; else dir=.; fi
  ( cd $dir && PYTHONPATH=/tmp/site:$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jc-$who timeout 195 python3 benchmarks/train_step.py --model k3-small --steps 8 --json $OUT/${who}_b8.json mesh.num_devices=1 train.batch_size=8 train.micro_batches=1 > $OUT/${who}_b8.log 2>&1 )
  echo "$who rc $?" >> $OUT/summary.txt
done
tail -3 $OUT/*_b8.log >> $OUT/summary.txt
cat $OUT/summary.txt
