# Run scratch/$1.sh in a clean copy of the committed tree (scratch/head.tgz = git archive of scratch/commit).
set -u
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-$1
w=/tmp/clean && rm -rf $w && mkdir -p $w && tar xzf scratch/head.tgz -C $w && cp scratch/commit $w/.commit && cp -r scratch $w/
cd $w && bash "scratch/$1.sh"
