# gmm check (all routings, the kernel path end to end), then the k3-small B8 step with a profile
source benchmarks/gpu_env.sh
timeout 210 python3 benchmarks/gmm_check.py --json $OUT/gmm_check.json > $OUT/gmm_check.log 2>&1
echo "check rc $?" >> $OUT/summary.txt
timeout 250 python3 benchmarks/train_step.py --model k3-small --steps 8 --profile /tmp/trace --hlo /tmp/step.hlo --json $OUT/new_b8.json mesh.num_devices=1 train.batch_size=8 train.micro_batches=1 > $OUT/new_b8.log 2>&1
echo "step rc $?" >> $OUT/summary.txt
timeout 60 python3 benchmarks/profile_summary.py /tmp/trace --top 45 --hlo /tmp/step.hlo > $OUT/profile_b8.txt 2>&1
echo "profile rc $?" >> $OUT/summary.txt
grep -v "^WARNING" $OUT/gmm_check.log | grep "routing" | cut -c1-200 >> $OUT/summary.txt
cat $OUT/summary.txt
