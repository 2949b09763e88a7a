# Run a script of scratch/ in a clean copy of the committed tree (HEAD, from scratch/head.tgz) on the GPU machine.
set -u
w=/tmp/clean && rm -rf $w && mkdir -p $w && tar xzf scratch/head.tgz -C $w && cp .commit $w/ && cp -r scratch $w/ && { [ -d .whl ] && cp -r .whl $w/ || true; }
cd $w && bash "scratch/$1"
