module kora.dev/nodeprobe

go 1.22
